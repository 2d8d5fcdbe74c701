"""A live resize of the device caches as one transaction: checked, then applied in place, or undone.

Each cache (expert slots, KV pages) resizes in place (cache/resizable_rows.py), so what a
resize needs is the net growth of device memory, not a second copy of the caches: the check
compares that with the memory free after the headroom. The caches that shrink go first (their
memory is handed back before the others grow into it); if a growth is then refused (the device
said no after all: another process took the memory), the caches already changed are changed
back, in reverse order, and the caller gets ResizeRolledBack naming the refusal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from freetoken.errors import EngineError, RequestError


class ResizeRolledBack(RequestError):
    """The device refused memory part-way through a resize; every cache is back at its old size.
    KV pages that no kept page mapped may have been overwritten by moved pages (the Scheduler
    drops the cached prefixes it had asked to drop)."""


@dataclass
class CacheChange:
    param: str  # the request field it answers ("moe_slots", "kv_tokens")
    what: str  # e.g. "12 expert slots"
    delta_bytes: int  # device memory it commits (< 0: gives back)
    apply: Callable[[], None]
    undo: Callable[[], None]


def check_budget(changes: list[CacheChange], free_bytes: int) -> None:
    """RequestError unless the net growth fits `free_bytes` (free memory after the headroom)."""
    need = sum(c.delta_bytes for c in changes)
    if need > max(free_bytes, 0):
        grown = max(changes, key=lambda c: c.delta_bytes)
        raise RequestError(
            f"{' and '.join(c.what for c in changes)} need {need / 2**30:.2f} GiB more device memory; "
            f"{max(free_bytes, 0) / 2**30:.2f} GiB are free after the headroom", param=grown.param)


def apply_changes(changes: list[CacheChange]) -> None:
    """Shrinks first, then growths; a refused growth undoes what was applied and raises
    ResizeRolledBack. An undo that fails too leaves the engine without the caches it had:
    EngineError, which fails the runner rather than serving from caches in an unknown state."""
    done: list[CacheChange] = []
    for change in sorted(changes, key=lambda c: c.delta_bytes):
        try:
            change.apply()
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            for applied in reversed(done):
                try:
                    applied.undo()
                except Exception as undo_exc:
                    raise EngineError(f"resizing to {change.what} failed ({exc}) and the caches could not be "
                                      f"restored ({undo_exc})") from undo_exc
            raise ResizeRolledBack(
                f"the device refused the memory for {change.what} ({type(exc).__name__}: {exc}); "
                "the caches are back at their old sizes and serving continues", param=change.param) from exc
        done.append(change)
