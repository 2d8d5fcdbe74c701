"""Numba threading set-up, core counting and the CPU memory-read probe.

Numba and torch share the process's OpenMP runtime, and Numba's workqueue layer aborts when
two threads enter parallel code at once (the CPU executor's worker beside a benchmark or the
main thread), so every Numba kernel here runs on the omp layer. `configure_threading` must run
before the first parallel Numba call in the process; importing `freetoken.kernels.cpu` does it.
Numba's thread count is per calling thread: each thread that runs a kernel sets its own.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange

log = logging.getLogger(__name__)
_checked = False


def configure_threading() -> None:
    """Ask for the omp threading layer, unless a parallel call has already fixed the layer."""
    try:
        numba.threading_layer()  # raises ValueError until the layer is launched
    except ValueError:
        numba.config.THREADING_LAYER = "omp"


def check_threading() -> str:
    """The layer in use (call after a parallel call); warns once if it is not omp."""
    global _checked
    layer = numba.threading_layer()
    if layer != "omp" and not _checked:
        log.warning(
            "Numba runs on the %r threading layer, not omp: it was launched before freetoken set it "
            "(import freetoken.kernels.cpu before any parallel Numba call); concurrent kernel calls "
            "from two threads may abort under workqueue", layer,
        )
    _checked = True
    return layer


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (SMT siblings counted once)."""
    cpus = sorted(os.sched_getaffinity(0))
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            return len(cpus)  # no topology exposed: count logical CPUs
    return len(cores)


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def kernel_threads() -> int:
    """Default thread count for the expert kernel: the physical cores but one, which stays with
    the thread driving the GPU (a kernel on every core stalls whenever that thread needs one: an
    OpenMP team waits for its slowest member)."""
    return max(1, physical_cores() - 1)


def last_level_cache_bytes() -> int | None:
    """Size of the largest CPU cache (the L3 on servers), from sysfs; None if not exposed."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=None)


def set_threads(threads: int | None) -> int:
    """Set the calling thread's Numba thread count (None: physical cores), clamped to the pool."""
    n = physical_cores() if threads is None else int(threads)
    n = max(1, min(n, numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    return n


@njit(parallel=True, nogil=True, fastmath={"reassoc", "contract", "nsz"}, cache=True)
def _parallel_sum(a, parts, streams):
    """Sum of the first parts * streams * size elements of a: each of `parts` threads reads its
    slice as `streams` interleaved sub-slices, 1 KB of each in turn (several streams per core,
    as the expert kernel reads several rows at once: one stream alone leaves bandwidth unused)."""
    size = a.shape[0] // (parts * streams)  # elements per stream
    acc = np.zeros(parts, np.float32)
    for t in prange(parts):
        s = np.float32(0.0)
        base = np.int64(t) * streams * size
        for b in range(0, size, 256):
            e = min(b + 256, size)
            for k in range(streams):
                off = base + k * size
                for i in range(off + b, off + e):
                    s += a[i]
        acc[t] = s
    return acc.sum()


def read_bandwidth(nbytes: int = 1 << 30, threads: int | None = None, repeats: int = 5, streams: int = 8) -> float:
    """Memory read rate in GB/s: the best of `repeats` parallel sums over an nbytes buffer
    (make it several times the last-level cache), `streams` read streams per thread."""
    n = set_threads(threads)
    a = np.ones(max(nbytes // 4, n * streams), np.float32)  # written once, so every page is resident
    _parallel_sum(a, n, streams)
    check_threading()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _parallel_sum(a, n, streams)
        best = min(best, time.perf_counter() - t0)
    return (a.shape[0] // (n * streams)) * n * streams * 4 / best / 1e9
