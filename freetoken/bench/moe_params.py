"""`bench --moe-param key=value`: the expert hierarchy's own parameters, which are not serve flags.

Each key names one EngineConfig field with its default; a value that does not parse, or a key
that names nothing, is refused with the keys there are.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError("takes a share in [0, 1]")
    return value


def _switch(text: str) -> bool:
    if text not in ("on", "off"):
        raise ValueError("takes on or off")
    return text == "on"


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("takes a whole number >= 1")
    return value


def _cpu_branch(text: str) -> str:
    if text not in ("worker", "inline"):
        raise ValueError("takes worker or inline")
    return text


# key -> (EngineConfig field, parser, what it sets)
MOE_PARAMS: dict[str, tuple[str, Callable[[str], object], str]] = {
    "ratio": ("moe_ratio", _share, "hybrid's PCIe share r (default: from the `bench bw` profile)"),
    "fetch_recurring": ("moe_fetch_recurring", _switch,
                        "hybrid fetches misses that recur whatever q* says (off: q* alone)"),
    "background_fills": ("moe_background_fills", _switch,
                         "hybrid's fetches beyond q* fill for later steps while this one runs them on the CPU"),
    "copy_fill_depth": ("moe_copy_fill_depth", _count,
                        "512 KiB chunks of copy-engine background fills that may stream in at once"),
    "cpu_branch": ("cpu_branch", _cpu_branch, "the eager path's CPU routes on the executor's worker or inline"),
}


def add_moe_param_argument(p: argparse.ArgumentParser) -> None:
    keys = "; ".join(f"{key}: {what}" for key, (_, _, what) in MOE_PARAMS.items())
    p.add_argument("--moe-param", action="append", default=[], metavar="KEY=VALUE",
                   help=f"an expert-hierarchy parameter (repeatable). {keys}")


def moe_config_fields(pairs: list[str]) -> dict[str, object]:
    """--moe-param's values -> EngineConfig keyword arguments; ValueError names a bad one."""
    fields: dict[str, object] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep:
            raise ValueError(f"--moe-param {pair!r}: expected KEY=VALUE")
        if key not in MOE_PARAMS:
            raise ValueError(f"--moe-param {key}: unknown key; one of {', '.join(MOE_PARAMS)}")
        field, parse, _ = MOE_PARAMS[key]
        try:
            fields[field] = parse(text)
        except ValueError as exc:
            raise ValueError(f"--moe-param {key}={text}: {exc}") from None
    return fields
