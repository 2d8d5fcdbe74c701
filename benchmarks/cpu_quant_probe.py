"""How fast the CPU expert kernel streams quantized experts, against the bf16 kernel, per byte.

    python -m benchmarks.cpu_quant_probe [--hidden 2048 --intermediate 768 --top-k 8 --tokens 1]
        [--pool-mib 4096] [--threads N] [--calls 40] [--out results.json]

For each format (bf16; Q8_0, Q4_K, Q5_K, Q6_K; a Q4_K_M-like mix: Q4_K gate/up, Q6_K down; and
gpt-oss's MXFP4 with bf16 biases, kernels/cpu/mxfp4_experts.py, whose experts also add biases and
the clamped SwiGLU) it builds a pool of random experts (one layer; random bytes are valid blocks once the f16
scales are finite), each call routing its tokens to experts no call has read since the whole
pool went by (`bench bw`'s `expert_calls`: DRAM rates, as in decode, when the pool is several
times the last-level cache), and prints the median call time and the rate: distinct expert
weight bytes per call / median time, in GB/s. A quantized expert is fewer bytes than a bf16
one, so at equal GB/s it is that many times fewer microseconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np

from freetoken.bench.bw import expert_calls
from freetoken.kernels.cpu.bandwidth import physical_cores, set_threads
from freetoken.kernels.cpu.experts import cpu_moe
from freetoken.kernels.cpu.mxfp4_experts import BIAS_BF16, Mxfp4Layout, cpu_moe_mxfp4
from freetoken.kernels.cpu.quant_experts import Q4_K, Q5_K, Q6_K, Q8_0, QuantLayout, cpu_moe_quant
from tests.quant_banks import make_quant_banks

FORMATS = {"Q8_0": (Q8_0, Q8_0), "Q4_K": (Q4_K, Q4_K), "Q5_K": (Q5_K, Q5_K), "Q6_K": (Q6_K, Q6_K),
           "Q4_K+Q6_K down": (Q4_K, Q6_K)}


def bf16_runner(rng, experts: int, H: int, I: int):
    w13 = rng.integers(0x3C00, 0x3D00, (experts, 2 * I, H), dtype=np.uint16)  # bf16 bits of modest values
    w2 = rng.integers(0x3C00, 0x3D00, (experts, H, I), dtype=np.uint16)
    return (lambda x, w, ids, out: cpu_moe(x, w, ids, w13, w2, out)), 2 * 3 * I * H


def quant_runner(rng, experts: int, H: int, I: int, types: tuple[int, int]):
    w13, w2, layout = make_quant_banks([types], experts, H, I, rng)
    nbytes = sum(layout.bank_bytes())
    return (lambda x, w, ids, out: cpu_moe_quant(x, w, ids, w13, w2, layout, out)), nbytes


def mxfp4_runner(rng, experts: int, H: int, I: int):
    """Random bytes are valid MXFP4 codes; scales near 2**0 and bf16 biases of modest values."""
    layout = Mxfp4Layout(BIAS_BF16, experts, H, I)
    banks = []
    for rows, columns, nbytes in ((2 * I, H, layout.bank_bytes()[0]), (H, I, layout.bank_bytes()[1])):
        bank = rng.integers(0, 256, (experts, nbytes), dtype=np.uint8)
        scales_at = rows * columns // 2
        bank[:, scales_at : scales_at + rows * columns // 32] = rng.integers(120, 128, (experts, rows * columns // 32))
        bank[:, scales_at + rows * columns // 32 :] = rng.integers(0x3C, 0x3E, (experts, 2 * rows)).astype(np.uint8)
        banks.append(bank)
    w13, w2 = banks
    return (lambda x, w, ids, out: cpu_moe_mxfp4(x, w, ids, w13, w2, layout, out)), sum(layout.bank_bytes())


def time_format(run, expert_bytes: int, pool_bytes: int, args, rng) -> tuple[float, float]:
    experts = max(args.top_k * args.tokens, pool_bytes // expert_bytes)
    x = rng.standard_normal((args.tokens, args.hidden)).astype(np.float32)
    weights = np.full((args.tokens, args.top_k), 1.0 / args.top_k, np.float32)
    out = np.empty_like(x)
    calls = expert_calls(rng, experts, args.top_k, args.tokens, args.calls + 2)
    run(x, weights, calls[0], out)  # compiled or loaded from the cache; not timed
    times = []
    for ids in calls[2:]:
        t0 = time.perf_counter()
        run(x, weights, ids, out)
        times.append(time.perf_counter() - t0)
    distinct = max(len(np.unique(ids)) for ids in calls)
    median = statistics.median(times)
    return median, distinct * expert_bytes / median / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--pool-mib", type=int, default=4096, help="bytes of each format's pool (several times the LLC)")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--threads", type=int, default=None, help="Numba threads (default: the physical cores)")
    ap.add_argument("--out", default=None, help="also write the table as JSON here (rates and ratios to bf16)")
    ap.add_argument("--formats", default="bf16," + ",".join(FORMATS) + ",MXFP4",
                    help="comma-separated, from bf16, MXFP4 and " + ", ".join(FORMATS))
    args = ap.parse_args()
    set_threads(args.threads or physical_cores())
    H, I = args.hidden, args.intermediate
    pool = args.pool_mib << 20
    print(f"H {H}  I {I}  top-{args.top_k}  tokens {args.tokens}  pool {args.pool_mib} MiB per format")
    print(f"{'format':>16} {'bytes/expert':>13} {'median us':>10} {'GB/s':>7}")
    rows = []
    for name in args.formats.split(","):
        rng = np.random.default_rng(0)
        if name == "bf16":
            expert_bytes = 2 * 3 * I * H
            run, _ = bf16_runner(rng, max(args.top_k * args.tokens, pool // expert_bytes), H, I)
        elif name == "MXFP4":
            expert_bytes = sum(Mxfp4Layout(BIAS_BF16, 1, H, I).bank_bytes())
            run, _ = mxfp4_runner(rng, max(args.top_k * args.tokens, pool // expert_bytes), H, I)
        elif name in FORMATS:
            expert_bytes = sum(QuantLayout(np.array([FORMATS[name]], np.int32), 1, H, I).bank_bytes())
            run, _ = quant_runner(rng, max(args.top_k * args.tokens, pool // expert_bytes), H, I, FORMATS[name])
        else:
            raise SystemExit(f"unknown format {name!r}: choose from bf16, MXFP4, {', '.join(FORMATS)}")
        median, rate = time_format(run, expert_bytes, pool, args, rng)
        print(f"{name:>16} {expert_bytes:>13} {median * 1e6:>10.1f} {rate:>7.2f}")
        rows.append({"format": name, "bytes_per_expert": expert_bytes, "median_us": round(median * 1e6, 1),
                     "gb_per_s": round(rate, 3)})
    if args.out:
        bf16 = next((r["gb_per_s"] for r in rows if r["format"] == "bf16"), None)
        for r in rows:
            r["ratio_to_bf16"] = round(r["gb_per_s"] / bf16, 3) if bf16 else None
        setup = {"hidden": H, "intermediate": I, "top_k": args.top_k, "tokens": args.tokens,
                 "pool_mib": args.pool_mib, "calls": args.calls, "threads": args.threads or physical_cores(),
                 "machine": platform.machine(), "processor": platform.processor()}
        with open(args.out, "w") as f:
            json.dump({"setup": setup, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
