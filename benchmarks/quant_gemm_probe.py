"""The quantized slot GEMM against the bf16 one at a decode shape, timed on the GPU.

    python -m benchmarks.quant_gemm_probe [--sweep] [--out FILE.json]

Defaults are qwen3-30b-a3b's expert shape (H 2048, I 768, top-8) at one token. For each
(gate/up type, down type) pair it times `quant_slots_gemm` inside CUDA graphs
(benchmarks/graph_timing.py), with a fresh draw of experts for every captured call as a step's
layers route, and prints the achieved bandwidth over the routed experts' weight bytes, next to
`moe_slots_gemm` over bf16 banks of the same shape. --sweep also tries other block shapes and
warps and prints the best per pair. Each pair's first call is checked against the fp32 expert
loop over `dequantize_rows`'s fp32 banks (under the registered pair's tolerance), and
`dequantize_rows` itself is timed over one slot's banks (the prefill path's conversion).
Without CUDA it runs once under Triton's interpreter (use a tiny shape): a smoke test, its times
mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import json
import os
import time

import torch

NAMES = {"Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
# --sweep walks one kernel's tiles at a time: the first kernel's (BLOCK_I, BLOCK_H) and warps with
# the second at its default, then the second's (BLOCK_H, BLOCK_I) and warps with the first's best.
SWEEP_ACT = [(8, 512), (4, 512), (16, 256), (8, 1024), (4, 2048), (16, 512)]
SWEEP_DOWN = [(4, 256), (8, 256), (2, 1024), (4, 1024), (8, 1024), (2, 256)]
SWEEP_WARPS = [2, 4]


def _time_us(fn, cuda: bool, calls: int) -> float:
    if cuda:
        from benchmarks.graph_timing import graph_us

        return graph_us(fn, calls=calls)
    start = time.perf_counter()
    fn(0)
    return (time.perf_counter() - start) * 1e6


def _bf16_call(x, weights, routes, w13, w2, i):
    from freetoken.kernels.triton.moe_gemm import moe_slots_gemm

    return moe_slots_gemm(x, weights, routes[i], w13, w2)


def _quant_call(gemm, routes, w13, w2, act, down, warps, i):
    return gemm(routes[i], w13, w2, act_blocks=act, down_blocks=down, warps=warps)


def _baseline_call(gemm, routes, w13, w2, i):
    return gemm(routes[i], w13, w2)


def _dequant_call(src, qtype, n, i):
    from freetoken.kernels.triton.quant_dequant import dequantize_rows

    return dequantize_rows(src, qtype, n)


def _quant_banks(rng, gu_type, d_type, slots, hidden, inter, device):
    from freetoken.kernels.specs.quant import random_rows

    w13 = random_rows(rng, gu_type, slots * 2 * inter, hidden).reshape(slots, -1)  # [S, 2I rows of H]
    w2 = random_rows(rng, d_type, slots * hidden, inter).reshape(slots, -1)  # [S, H rows of I]
    return torch.from_numpy(w13).to(device), torch.from_numpy(w2).to(device)


def _check(x, weights, routes, w13, w2, gu_type, d_type, hidden, inter, got) -> float:
    """The kernel's largest error over the registered bound (<= 1 passes), against the fp32 loop
    over the routed slots' banks dequantized on the device."""
    from freetoken.kernels.triton.quant_dequant import dequantize_rows
    from freetoken.reference.moe_slots import moe_slots

    used = sorted({s for s in routes.flatten().tolist() if s >= 0})
    remap = torch.full((w13.shape[0],), -1, dtype=torch.int32, device=x.device)
    remap[used] = torch.arange(len(used), dtype=torch.int32, device=x.device)
    sel = torch.tensor(used, device=x.device)
    w13_f = dequantize_rows(w13[sel].reshape(len(used) * 2 * inter, -1), gu_type, hidden, torch.float32)
    w2_f = dequantize_rows(w2[sel].reshape(len(used) * hidden, -1), d_type, inter, torch.float32)
    want = moe_slots(x, weights, remap[routes.long()], w13_f.view(len(used), 2 * inter, hidden),
                     w2_f.view(len(used), hidden, inter))
    rel = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}.get(x.dtype, 2.0**-20)
    bound = rel * want.double().abs() + 2.0**-16 * want.double().abs().max()
    return float(((got.double() - want.double()).abs() / bound).max())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--slots", type=int, default=64, help="slots per bank (enough that calls miss in L2)")
    p.add_argument("--pairs", default="Q4_K:Q6_K,Q4_K:Q4_K,Q5_K:Q6_K,Q6_K:Q6_K,Q8_0:Q8_0",
                   help="gate/up type:down type, comma separated")
    p.add_argument("--calls", type=int, default=32, help="captured calls per graph (fresh routes each)")
    p.add_argument("--sweep", action="store_true", help="also try other block shapes and warps")
    p.add_argument("--baseline", default=None,
                   help="also time this module's quant_slots_gemm at its own defaults (e.g. an earlier kernel kept "
                        "under benchmarks/ for an A/B in one run)")
    p.add_argument("--out", default=None, help="write the rows as JSON")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported
    import numpy as np

    from freetoken.kernels.triton.quant_dequant import row_bytes
    from freetoken.kernels.triton.quant_moe_gemm import (
        ACT_BLOCKS,
        DOWN_BLOCKS,
        DOWN_BLOCKS_BATCH,
        WARPS,
        quant_slots_gemm,
    )

    device = "cuda" if cuda else "cpu"
    H, inter, K, N, S = args.hidden, args.inter, args.top_k, args.tokens, args.slots
    calls = args.calls if cuda else 1
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(N, H, device=device, generator=g).to(torch.bfloat16)
    weights = torch.rand(N, K, device=device, generator=g)
    routes = [torch.stack([torch.randperm(S, device=device, generator=g)[:K] for _ in range(N)]).int()
              for _ in range(calls)]
    distinct = sum(len(set(r.flatten().tolist())) for r in routes) / calls
    rows = []

    w13 = (torch.randn(S, 2 * inter, H, device=device, generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(S, H, inter, device=device, generator=g) * 0.02).to(torch.bfloat16)
    bf16_bytes = (w13[0].numel() + w2[0].numel()) * 2
    us = _time_us(functools.partial(_bf16_call, x, weights, routes, w13, w2), cuda, calls)
    rows.append(dict(kernel="moe_slots_gemm bf16", us=us, GBps=distinct * bf16_bytes / us / 1e3))
    print(f"bf16 moe_slots_gemm: {us:.1f} us, {rows[-1]['GBps']:.0f} GB/s", flush=True)
    del w13, w2

    rng = np.random.default_rng(0)
    for pair in args.pairs.split(","):
        gu_name, d_name = pair.split(":")
        gu_type, d_type = NAMES[gu_name], NAMES[d_name]
        qw13, qw2 = _quant_banks(rng, gu_type, d_type, S, H, inter, device)
        expert_bytes = 2 * inter * row_bytes(gu_type, H) + H * row_bytes(d_type, inter)
        gemm = functools.partial(quant_slots_gemm, x, weights, gu_type=gu_type, d_type=d_type, hidden=H, inter=inter)
        error = _check(x, weights, routes[0], qw13, qw2, gu_type, d_type, H, inter,
                       gemm(routes[0], qw13, qw2))
        default = (ACT_BLOCKS, (DOWN_BLOCKS if N == 1 else DOWN_BLOCKS_BATCH)[d_type], WARPS)
        pair_rows = []

        def timed(act, down, warps, gemm=gemm, pair_rows=pair_rows, qw13=qw13, qw2=qw2, expert_bytes=expert_bytes,
                  pair=pair, error=error):
            fn = functools.partial(_quant_call, gemm, routes, qw13, qw2, act, down, warps)
            us = _time_us(fn, cuda, calls)
            pair_rows.append(dict(kernel=f"quant_slots_gemm {pair}", act_blocks=act, down_blocks=down, warps=warps,
                                  us=us, GBps=distinct * expert_bytes / us / 1e3, error_over_bound=error))
            return us

        timed(*default)
        if args.sweep:
            best_act = min(((a, w) for a in SWEEP_ACT for w in SWEEP_WARPS),
                           key=lambda aw: timed(aw[0], default[1], (aw[1], default[2][1])))
            for down, w in itertools.product(SWEEP_DOWN, SWEEP_WARPS):
                timed(best_act[0], down, (best_act[1], w))
        if args.baseline:
            base = importlib.import_module(args.baseline).quant_slots_gemm
            base_gemm = functools.partial(base, x, weights, gu_type=gu_type, d_type=d_type, hidden=H, inter=inter)
            us = _time_us(functools.partial(_baseline_call, base_gemm, routes, qw13, qw2), cuda, calls)
            base_error = _check(x, weights, routes[0], qw13, qw2, gu_type, d_type, H, inter,
                                base_gemm(routes[0], qw13, qw2))
            rows.append(dict(kernel=f"{args.baseline} {pair}", us=us, GBps=distinct * expert_bytes / us / 1e3,
                             error_over_bound=base_error))
            print(f"{pair}: baseline {args.baseline} {us:.1f} us {rows[-1]['GBps']:.0f} GB/s", flush=True)
        rows += pair_rows
        best = min(pair_rows, key=lambda r: r["us"])
        print(f"{pair}: default {pair_rows[0]['us']:.1f} us {pair_rows[0]['GBps']:.0f} GB/s; best {best['us']:.1f} us "
              f"{best['GBps']:.0f} GB/s at act {best['act_blocks']} down {best['down_blocks']} warps {best['warps']}; "
              f"error/bound {error:.3g}", flush=True)
        src = qw13[0].view(2 * inter, -1)  # one slot's gate and up rows -> bf16 (the prefill conversion)
        us = _time_us(functools.partial(_dequant_call, src, gu_type, H), cuda, calls)
        moved = src.numel() + 2 * inter * H * 2  # bytes read and written
        rows.append(dict(kernel=f"dequantize_rows {gu_name}", us=us, GBps=moved / us / 1e3))
        print(f"  dequantize_rows {gu_name} [{2 * inter}, {H}] -> bf16: {us:.1f} us, {rows[-1]['GBps']:.0f} GB/s "
              "read+written", flush=True)
        del qw13, qw2, src, gemm
    if args.out:
        gpu = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)"
        json.dump(dict(gpu=gpu, hidden=H, inter=inter, top_k=K, tokens=N, slots=S, rows=rows),
                  open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
