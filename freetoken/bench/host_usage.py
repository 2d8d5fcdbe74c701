"""The host-side figures a bench report carries beside its speeds: how big the checkpoint is on
disk and the most host memory the process held, so that a run shows what it cost in RAM (a GGUF
served from a pool of its own blocks should stay near the file's size)."""

from __future__ import annotations

import re
import resource
import sys
from pathlib import Path

_SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def checkpoint_bytes(model: str | Path) -> int:
    """Bytes on disk of a checkpoint: a directory's files, a GGUF file, or every part of a split
    GGUF named by its first part (`NAME-00001-of-0000N.gguf`)."""
    path = Path(model)
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    split = _SPLIT_PART.search(path.name)
    if split is None:
        return path.stat().st_size
    stem = path.name[: split.start()]
    parts = int(split.group(2))
    return sum((path.parent / f"{stem}-{i:05d}-of-{parts:05d}.gguf").stat().st_size for i in range(1, parts + 1))


def peak_rss_bytes() -> int:
    """The process's peak resident set so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
