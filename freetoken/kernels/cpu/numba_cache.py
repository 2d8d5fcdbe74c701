"""Numba's on-disk cache, kept honest about code in other modules.

Numba reuses a cached compiled function while the file that defines it is unchanged, but the
functions it calls from other modules are compiled into it: edit one of those, and the cached
code still runs the old version (with changed constants, it reads the wrong fields and can
crash). `drop_stale_cache(__file__, deps)` at the top of a module with cached functions deletes
that module's cache files whenever a dependency's source changed since they were written.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def drop_stale_cache(module_file: str, dependencies: list[str]) -> None:
    """Delete the Numba cache files of `module_file` (its `__pycache__`, and NUMBA_CACHE_DIR's
    copy) when the sources of `dependencies` (module files) differ from those the cache was built
    with; records the new digest. Where the cache directory cannot be written, nothing happens
    (an installed package changes only by reinstalling, which renews the module file too)."""
    module = Path(module_file)
    digest = hashlib.sha256(b"".join(Path(d).read_bytes() for d in sorted(dependencies))).hexdigest()
    dirs = [module.parent / "__pycache__"]
    if os.environ.get("NUMBA_CACHE_DIR"):
        dirs.append(Path(os.environ["NUMBA_CACHE_DIR"]))
    for cache_dir in dirs:
        stamp = cache_dir / f"{module.stem}.deps"
        try:
            if stamp.exists() and stamp.read_text() == digest:
                continue
            cache_dir.mkdir(parents=True, exist_ok=True)
            stale = [p for p in cache_dir.rglob(f"{module.stem}.*") if p.suffix in (".nbi", ".nbc")]
            for p in stale:
                p.unlink()
            stamp.write_text(digest)
            if stale:
                log.info("dropped %d stale Numba cache files of %s (a module it calls changed)", len(stale),
                         module.name)
        except OSError:
            continue
