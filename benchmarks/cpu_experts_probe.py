"""Which loop shape of the CPU expert kernel moves expert bytes fastest on this machine.

    python -m benchmarks.cpu_experts_probe --out cpu_experts_probe.json [--threads 16]

Times, for qwen3-30b-a3b experts (H 2048, I 768, bf16, top-8) at batch 1, 2 and 4 (each token
routed to 8 distinct experts; every call, of every variant, gets experts no call has read since
the whole pool, several times the last-level cache, went by: DRAM rates, as in decode):
  - `cpu_moe` (the shape the engine uses) and `cpu_moe_tuned` with other row blockings
    (gN: intermediate indices per gate/up pass, dN: rows per down pass), software prefetch
    (pfN: N passes ahead), and dynamic scheduling (chN: Numba parallel chunk size);
  - `cpu_moe` and the plain g4 d8 at fewer threads (does the memory bus saturate before all
    cores?), each thread count in its own block: a call on another thread count than the last
    one pays for the OpenMP team's change (seen: ~30% slower);
  - torch's bf16 CPU matmuls (oneDNN, AMX where present);
  - the Numba memory-read ceiling (8 streams per thread; also 1, as a plain parallel sum reads).
Rate = distinct expert bytes per call / median call time. Numba variants are timed round-robin
(drift hits all alike); torch runs after them, on its own (two OpenMP pools spinning at once
would slow both). Every variant is first checked against `cpu_moe` on one call.
The 16-core H200 host has a 300 MB L3: there a pool under ~1 GB, or the same experts timed twice
in a row, reported cache rates (up to twice DRAM's).
Writes one JSON file (--out) and prints a table. About 40 s on that host (5 GB of banks).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import shlex
import statistics
import sys
import time

import numba
import numpy as np

from freetoken.bench.bw import expert_calls
from freetoken.kernels.cpu.bandwidth import check_threading, cpu_model, physical_cores, read_bandwidth, set_threads
from freetoken.kernels.cpu.experts import DOWN_ROWS, GATE_ROWS, PREFETCH, cpu_moe, cpu_moe_torch, cpu_moe_tuned

# name -> (gate_rows, down_rows, prefetch passes, parallel chunk size; 0 = static split)
VARIANTS = {
    "g1 d2": (1, 2, 0, 0),
    "g2 d4": (2, 4, 0, 0),
    "g4 d8": (4, 8, 0, 0),
    "g2 d4 pf1": (2, 4, 1, 0),
    "g4 d4 pf1": (4, 4, 1, 0),
    "g4 d8 pf1": (4, 8, 1, 0),
    "g4 d8 pf2": (4, 8, 2, 0),
    "g4 d8 ch4": (4, 8, 0, 4),
    "g4 d8 pf1 ch4": (4, 8, 1, 4),
    "g4 d8 pf1 ch16": (4, 8, 1, 16),
}
MAIN = "cpu_moe"


def build_banks(experts: int, hidden: int, inter: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random bf16 banks (normal values): w13 [E, 2I, H], w2 [E, H, I]."""
    rng = np.random.default_rng(seed)
    banks = []
    for shape in ((experts, 2 * inter, hidden), (experts, hidden, inter)):
        bank = np.empty(shape, np.uint16)
        for e in range(0, experts, 8):  # a few distinct experts, repeated: speed sees addresses only
            bank[e:e + 8] = ((rng.standard_normal(shape[1:], dtype=np.float32) * 0.05).view(np.uint32)
                             >> 16).astype(np.uint16)
        banks.append(bank)
    return banks[0], banks[1]


def cpu_run_header(command: str, threads: int) -> dict:
    """What every CPU-kernel results file starts with: the command, the machine, the date."""
    return {"command": command,
            "machine": {"cpu": cpu_model(), "platform": platform.platform(), "threads": threads,
                        "numba_threading_layer": check_threading()},
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def split_threads(name: str, default: int) -> tuple[str, int]:
    """'g4 d8 t12' -> ('g4 d8', 12); a name without a ' tN' suffix runs on `default` threads."""
    base, _, last = name.rpartition(" t")
    return (base, int(last)) if base and last.isdigit() else (name, default)


def numba_runner(name: str, default_threads: int, w13: np.ndarray, w2: np.ndarray):
    base, threads = split_threads(name, default_threads)
    g, d, pf, chunk = VARIANTS.get(base, (GATE_ROWS, DOWN_ROWS, PREFETCH, 0))

    def run(x, weights, ids, out) -> None:
        numba.set_num_threads(threads)
        with numba.parallel_chunksize(chunk) if chunk else contextlib.nullcontext():
            if base == MAIN:
                cpu_moe(x, weights, ids, w13, w2, out)
            else:
                cpu_moe_tuned(x, weights, ids, w13, w2, out, g, d, pf)

    return run


def time_round_robin(runners: dict, calls: list[np.ndarray], x: np.ndarray, weights: np.ndarray,
                     out: np.ndarray) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Seconds per call and distinct experts per call, for each runner; call j of runner v
    takes calls[j * len(runners) + v], so no two timed calls share experts within a pass."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    distinct: dict[str, list[int]] = {name: [] for name in runners}
    for run in runners.values():  # warm-up: compile / load
        run(x, weights, np.full_like(calls[0], -1), out)
    it = iter(calls)
    for _ in range(len(calls) // len(runners)):
        for name, run in runners.items():
            ids = next(it)
            t0 = time.perf_counter()
            run(x, weights, ids, out)
            times[name].append(time.perf_counter() - t0)
            distinct[name].append(len(np.unique(ids)))
    return times, distinct


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON result file")
    p.add_argument("--threads", type=int, default=None, help="default: physical cores")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=512, help="pool size (512 x 9.4 MB = 4.8 GB)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--read-mib", type=int, default=2048)
    p.add_argument("--no-torch", action="store_true")
    args = p.parse_args(argv)

    t_start = time.perf_counter()
    threads = set_threads(args.threads)
    H, I, K = args.hidden, args.intermediate, args.top_k
    w13, w2 = build_banks(args.experts, H, I)
    expert_bytes = w13[0].nbytes + w2[0].nbytes
    read_Bps = read_bandwidth(args.read_mib << 20, threads) * 1e9
    read_1_Bps = read_bandwidth(args.read_mib << 20, threads, streams=1) * 1e9

    sweep = sorted({t for t in (threads // 2, (3 * threads) // 4, threads - 1) if 0 < t < threads})
    groups = [[MAIN, *VARIANTS], *([f"{MAIN} t{t}", f"g4 d8 t{t}"] for t in sweep)]
    rng = np.random.default_rng(1)
    results = []
    for batch in args.batches:
        x = rng.standard_normal((batch, H), dtype=np.float32)
        weights = np.full((batch, K), 1.0 / K, np.float32)
        out = np.empty_like(x)
        check = expert_calls(rng, args.experts, K, batch, 1)[0]
        want = np.empty_like(x)
        numba_runner(MAIN, threads, w13, w2)(x, weights, check, want)
        scale = float(np.abs(want).max())
        times, distinct = {}, {}
        for names in groups:
            runners = {n: numba_runner(n, threads, w13, w2) for n in names}
            for n, run in runners.items():
                run(x, weights, check, out)
                err = float(np.abs(out - want).max()) / scale
                if err > 1e-5:
                    raise SystemExit(f"variant {n!r} disagrees with cpu_moe: max error {err:.2e} of scale")
            calls = expert_calls(rng, args.experts, K, batch, args.repeats * len(runners))
            t, d = time_round_robin(runners, calls, x, weights, out)
            times.update(t)
            distinct.update(d)
        if not args.no_torch:
            import torch

            torch.set_num_threads(threads)
            torch_run = {"torch bf16": lambda x, w, ids, o: cpu_moe_torch(x, w, ids, w13, w2, o)}  # noqa: B023
            calls = expert_calls(rng, args.experts, K, batch, max(10, args.repeats // 2))
            t, d = time_round_robin(torch_run, calls, x, weights, out)
            times.update(t)
            distinct.update(d)
        for n, ts in times.items():
            med = statistics.median(ts)
            bytes_per_call = statistics.mean(distinct[n]) * expert_bytes
            results.append({
                "variant": n, "batch": batch,
                "threads": split_threads(n, threads)[1],
                "median_s": med, "min_s": min(ts), "distinct_experts": statistics.mean(distinct[n]),
                "Bps": bytes_per_call / med, "of_read_ceiling": bytes_per_call / med / read_Bps,
            })

    read_end_Bps = read_bandwidth(args.read_mib << 20, threads) * 1e9  # drift check: other tenants
    best = {}
    for batch in args.batches:
        rows = [r for r in results if r["batch"] == batch]
        best[str(batch)] = max(rows, key=lambda r: r["Bps"])["variant"]
    report = {
        "command": "python -m benchmarks.cpu_experts_probe " + shlex.join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "physical_cores": physical_cores(), "threads": threads,
                    "numba": numba.__version__, "numba_threading_layer": check_threading(),
                    "numpy": np.__version__, "torch": getattr(sys.modules.get("torch"), "__version__", None),
                    "python": platform.python_version()},
        "shape": {"hidden": H, "intermediate": I, "top_k": K, "experts": args.experts,
                  "expert_bytes": expert_bytes},
        "main_kernel": {"gate_rows": GATE_ROWS, "down_rows": DOWN_ROWS, "prefetch": PREFETCH},
        "read_ceiling_Bps": read_Bps,
        "read_ceiling_end_Bps": read_end_Bps,
        "read_one_stream_per_thread_Bps": read_1_Bps,
        "results": results,
        "best_by_batch": best,
        "wall_s": time.perf_counter() - t_start,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)

    print(f"read ceiling {read_Bps / 1e9:.1f} GB/s (at the end: {read_end_Bps / 1e9:.1f}; one stream per thread: "
          f"{read_1_Bps / 1e9:.1f}), {threads} threads, "
          f"expert {expert_bytes / 1e6:.2f} MB, main kernel g{GATE_ROWS} d{DOWN_ROWS} pf{PREFETCH}")
    print(f"{'variant':<16}" + "".join(f"  b{b}: ms    GB/s" for b in args.batches))
    for n in dict.fromkeys(r["variant"] for r in results):
        row = {r["batch"]: r for r in results if r["variant"] == n}
        print(f"{n:<16}" + "".join(f"  {row[b]['median_s'] * 1e3:6.3f} {row[b]['Bps'] / 1e9:6.1f}"
                                   for b in args.batches))
    print(f"best by batch: {best}; wall {report['wall_s']:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
