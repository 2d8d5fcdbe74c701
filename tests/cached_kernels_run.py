"""One process's turn of tests/test_numba_cache.py: calls every cached compiled function of
`freetoken.kernels.cpu` once, checks each result, and prints JSON of where each function's code
came from (compiled here, or loaded from Numba's on-disk cache).

Run as `python -m tests.cached_kernels_run` from the repository root, with NUMBA_CACHE_DIR set.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import threading

import numpy as np

import freetoken.kernels.cpu as cpu_package


def cached_dispatchers() -> dict[str, object]:
    """Every compiled function of the package that keeps its code on disk, by qualified name."""
    from numba.core.caching import NullCache
    from numba.core.registry import CPUDispatcher

    found = {}
    for info in pkgutil.iter_modules(cpu_package.__path__):
        module = importlib.import_module(f"{cpu_package.__name__}.{info.name}")
        for name, value in vars(module).items():
            if (isinstance(value, CPUDispatcher) and value.__module__ == module.__name__
                    and not isinstance(value._cache, NullCache)):
                found[f"{module.__name__}.{name}"] = value
    return found


def run_every_cached_function() -> None:
    from freetoken.kernels.cpu.bandwidth import read_bandwidth
    from freetoken.kernels.cpu.doorbell import CycleClock, cycles_now
    from freetoken.kernels.cpu.executor import CpuExpertExecutor
    from freetoken.kernels.cpu.experts import cpu_moe
    from freetoken.kernels.cpu.mailbox import Mailbox
    from tests.test_cpu_experts import TOL, make_case, rel_err, twin
    from tests.test_doorbell import gpu_side

    F, H, I, K = 5, 64, 40, 2
    x, weights, ids, w13, w2 = make_case(F, H, I, 3, K)
    out = np.full_like(x, np.nan)
    cpu_moe(x, weights, ids, w13, w2, out)  # experts.cpu_moe_tuned
    assert rel_err(out, twin(x, weights, ids, w13, w2)) <= TOL

    assert int(cycles_now()) > 0 and CycleClock().duration_ns(0) == 0  # doorbell.cycles_now
    assert read_bandwidth(nbytes=1 << 20, threads=1, repeats=1) > 0  # bandwidth._parallel_sum

    for poller in ("per-call", "team"):  # doorbell.serve_rings, doorbell.serve_rings_team
        mailbox = Mailbox(rows=3, top_k=K, hidden=H, pinned=False)
        results: list = []
        with CpuExpertExecutor(w13, w2, threads=2, poller=poller) as ex:
            ticket = ex.serve(mailbox, 1, 1)
            gpu = threading.Thread(target=gpu_side, args=(mailbox, [(0, x, weights, ids)], results))
            gpu.start()
            mailbox.finish(ticket, drained=lambda: True, timeout=30)
            gpu.join(30)
            assert ex.poller == poller
        np.testing.assert_array_equal(results[0], out)

    run_quantized_kernels()
    run_mxfp4_kernel()


def run_mxfp4_kernel() -> None:
    """mxfp4_experts.cpu_moe_mxfp4_tuned through the executor, and both pollers compiled for MXFP4 banks."""
    import torch

    from freetoken.kernels.cpu.executor import CpuExpertExecutor
    from tests.mxfp4_banks import error_bound, make_mxfp4_banks, twin
    from tests.test_doorbell import answers_through_poller

    w13, w2, fmt, layout = make_mxfp4_banks(3, 64, 96, torch.bfloat16, seed=0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    weights = rng.random((2, 2)).astype(np.float32)
    ids = np.array([[0, 2], [1, -1]], np.int32)
    with CpuExpertExecutor(w13, w2, threads=2, layout=layout) as ex:
        out = ex.submit(x, weights, ids, np.full_like(x, np.nan)).wait(60)
    assert np.all(np.abs(out - twin(x, weights, ids, w13, w2, fmt)) <= error_bound(x, weights, ids, w13, w2, fmt))
    for poller in ("per-call", "team"):
        results = answers_through_poller(w13, w2, layout, poller, [(0, x, weights, ids)], rows=2, top_k=2, hidden=64)
        np.testing.assert_array_equal(results[0], out)


def run_quantized_kernels() -> None:
    """quant_experts.cpu_moe_quant_tuned, and both pollers compiled for quantized banks."""
    from freetoken.kernels.cpu.quant_experts import Q4_K, Q8_0, cpu_moe_quant
    from tests.quant_banks import make_quant_banks
    from tests.test_doorbell import answers_through_poller

    rng = np.random.default_rng(0)
    E, H, I, K = 2, 256, 256, 2
    w13, w2, layout = make_quant_banks([(Q4_K, Q8_0)], E, H, I, rng)
    x = rng.standard_normal((2, H)).astype(np.float32)
    weights = rng.random((2, K)).astype(np.float32)
    ids = np.array([[0, 1], [1, -1]], np.int32)
    out = np.full_like(x, np.nan)
    cpu_moe_quant(x, weights, ids, w13, w2, layout, out)
    assert np.isfinite(out).all() and out.any()
    for poller in ("per-call", "team"):
        results = answers_through_poller(w13, w2, layout, poller, [(0, x, weights, ids)], rows=2, top_k=K, hidden=H)
        assert np.abs(results[0] - out).max() <= 1e-5 * np.abs(out).max()


def main() -> None:
    run_every_cached_function()
    report = {}
    for name, dispatcher in cached_dispatchers().items():
        stats = dispatcher.stats
        report[name] = {"hits": sum(stats.cache_hits.values()), "misses": sum(stats.cache_misses.values())}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
