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


def set_threads(threads: int | None) -> int:
    """Set the calling thread's Numba thread count (None: physical cores), clamped to the pool."""
    n = physical_cores() if threads is None else int(threads)
    n = max(1, min(n, numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    return n


@njit(parallel=True, nogil=True, fastmath={"reassoc", "contract", "nsz"}, cache=True)
def _parallel_sum(a, parts):
    """Sum of a, as `parts` contiguous slices read one per thread (static split)."""
    n = a.shape[0]
    size = (n + parts - 1) // parts
    acc = np.zeros(parts, np.float32)
    for t in prange(parts):
        s = np.float32(0.0)
        for i in range(t * size, min(n, (t + 1) * size)):
            s += a[i]
        acc[t] = s
    return acc.sum()


def read_bandwidth(nbytes: int = 1 << 30, threads: int | None = None, repeats: int = 5) -> float:
    """Memory read rate in GB/s: the best of `repeats` parallel sums over an nbytes buffer
    (make it far larger than the last-level cache)."""
    n = set_threads(threads)
    a = np.ones(max(nbytes // 4, 1), np.float32)  # written once, so every page is resident
    _parallel_sum(a, n)
    check_threading()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _parallel_sum(a, n)
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9
