"""The CPU expert kernel at decode's call sizes: one, two, four and eight experts a call, batch 1.

    python -m benchmarks.cpu_small_calls --out cpu-small-calls.json [--compare OLD_EXPERTS_PY]

In a hybrid decode step the CPU gets the misses that q* leaves it, one or two experts a layer,
not the eight of a whole layer that `bench bw` and `cpu_experts_probe` time. Here each call
reads experts no call has read since the whole pool (several times the last-level cache) went
by, as in decode. Rate = expert bytes per call / median call time. `--compare` loads another
version of `freetoken/kernels/cpu/experts.py` (say, `git show REV:freetoken/kernels/cpu/experts.py`)
and times its `cpu_moe` alternating with ours, call by call, so drift hits both alike; each
call reads its own fresh experts (an expert read twice in a row would come from the
last-level cache). The two must agree on a shared first call. `--gap-us` waits that long
(spinning, as the doorbell's poller does) before each call: in decode the CPU team idles for a
layer's GPU work between its calls, and an OpenMP team that has gone to sleep pays to wake up.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import statistics
import sys
import time

import numpy as np

from benchmarks.cpu_experts_probe import build_banks, cpu_run_header
from freetoken.bench.bw import expert_calls
from freetoken.kernels.cpu.bandwidth import kernel_threads, set_threads
from freetoken.kernels.cpu.experts import cpu_moe

HIDDEN, INTER = 2048, 768  # qwen3-30b-a3b


def _load(path: str):
    spec = importlib.util.spec_from_file_location("experts_compared", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Numba's cache finds compiled functions through their module
    spec.loader.exec_module(module)
    return module.cpu_moe


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", default="1,2,4,8", help="experts per call, comma-separated")
    p.add_argument("--pool", type=int, default=512, help="experts in the bank (512: 4.8 GB)")
    p.add_argument("--calls", type=int, default=300, help="timed calls per size and version")
    p.add_argument("--threads", type=int, default=None, help="Numba threads (default: the executor's)")
    p.add_argument("--compare", default=None, help="another experts.py whose cpu_moe is timed alongside")
    p.add_argument("--gap-us", type=float, default=0.0, help="idle time before each call (spin-wait)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    threads = args.threads or kernel_threads()
    set_threads(threads)
    w13, w2 = build_banks(args.pool, HIDDEN, INTER)
    expert_bytes = (w13[0].nbytes + w2[0].nbytes)
    versions = {"current": cpu_moe}
    if args.compare:
        versions["compared"] = _load(args.compare)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, HIDDEN), dtype=np.float32)
    rows = []
    for count in (int(c) for c in args.experts.split(",")):
        weights = np.full((1, count), 1.0 / count, np.float32)
        calls = expert_calls(rng, args.pool, count, 1, (args.calls + 5) * len(versions))
        outs = {name: np.empty_like(x) for name in versions}
        times = {name: [] for name in versions}
        if len(versions) == 2:
            for name, fn in versions.items():
                fn(x, weights, calls[0], w13, w2, outs[name])
            a, b = outs.values()
            if not np.allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(a).max())):
                raise SystemExit("the compared cpu_moe disagrees with ours")
        for i, ids in enumerate(calls):
            name = list(versions)[i % len(versions)]
            if args.gap_us > 0:
                until = time.perf_counter() + args.gap_us * 1e-6
                while time.perf_counter() < until:
                    pass
            t0 = time.perf_counter()
            versions[name](x, weights, ids, w13, w2, outs[name])
            if i >= 5 * len(versions):  # the first calls compile and warm the team
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            med = statistics.median(ts)
            rows.append({"version": name, "experts": count, "median_us": med * 1e6,
                         "p90_us": sorted(ts)[int(0.9 * len(ts))] * 1e6, "gb_per_s": count * expert_bytes / med / 1e9})
            print(f"{name:9s} {count} experts: {med * 1e6:7.1f} us  {rows[-1]['gb_per_s']:5.1f} GB/s", file=sys.stderr)
    result = {
        **cpu_run_header(f"python -m benchmarks.cpu_small_calls {shlex.join(sys.argv[1:] if argv is None else argv)}",
                         threads),
        "expert_bytes": expert_bytes, "pool_experts": args.pool, "calls": args.calls, "gap_us": args.gap_us,
        "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_"))},
        "results": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
