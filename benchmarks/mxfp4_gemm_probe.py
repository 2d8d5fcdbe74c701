"""The MXFP4 slot GEMM against the torch path and the bf16 GEMM at a decode shape, timed on the GPU.

    python -m benchmarks.mxfp4_gemm_probe [--sweep] [--tokens N] [--out FILE.json]

Defaults are gpt-oss-120b's expert shape (H 2880, I 2880, top-4, bf16 biases) at one token over
32 slots (~13 MB an expert, so a call's experts miss in L2). It times `mxfp4_slots_gemm`
(kernels/triton/mxfp4_moe_gemm.py, `--moe-gemm triton`) inside CUDA graphs
(benchmarks/graph_timing.py), with a fresh draw of experts for every captured call as a step's
layers route, and prints the achieved bandwidth over the routed experts' MXFP4 bytes (codes,
scales, biases); next to it the torch path (`Mxfp4ExpertFormat.slot_gemm("torch")`, what
`--moe-gemm torch` serves, and `auto` off CUDA: each routed slot dequantized, then the expert loop) on the same
banks, and `moe_slots_gemm` over biasless bf16 banks of the same shape as a bandwidth reference.
The torch path reads its routes on the host (`expert_loop`'s bincount), so it cannot be captured:
it is timed eagerly, launches included, with a synchronize around the repeated calls (its row
says so). --sweep also tries other block shapes and warps of the Triton kernel and prints the best.
Each variant's first call is checked against the registered twin (kernels/specs/mxfp4.py:
`dequantize_mxfp4` of the banks and the fp32 clamped-SwiGLU loop) and its largest error over the
pair's bound is printed (<= 1 passes; the torch path rounds to bf16 where the loop does and is
not held to that bound). Banks are drawn by the spec's `random_projection`.
Without CUDA it runs once under Triton's interpreter (use a tiny shape): a smoke test, its times
mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import time

import torch

# --sweep walks one kernel's tiles at a time: the act kernel's (BLOCK_I, BLOCK_H) and warps with
# the down kernel at its default, then the down kernel's (BLOCK_H, BLOCK_I) and warps with the
# act kernel's best. The first number is a power of two (rows per program), the second a power of
# two >= 32 (a whole number of MXFP4 blocks per pass); every tile is <= 8192 decoded codes.
SWEEP_ACT = [(8, 512), (4, 512), (16, 256), (8, 1024), (4, 1024), (2, 1024)]
SWEEP_DOWN = [(8, 512), (4, 512), (16, 256), (8, 1024), (4, 1024), (16, 512)]
SWEEP_WARPS = [2, 4, 8]
BIASES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _valid(tile: tuple[int, int]) -> bool:
    rows, columns = tile
    return rows >= 1 and rows & (rows - 1) == 0 and columns >= 32 and columns & (columns - 1) == 0


def _time_us(fn, cuda: bool, calls: int) -> float:
    if cuda:
        from benchmarks.graph_timing import graph_us

        return graph_us(fn, calls=calls)
    start = time.perf_counter()
    fn(0)
    return (time.perf_counter() - start) * 1e6


def _eager_us(fn, cuda: bool, calls: int) -> float:
    """Microseconds per call of fn(i), launched from Python: warmed, then `REPLAYS` rounds of the
    `calls` calls between two synchronizes (for what a graph cannot capture)."""
    if not cuda:
        return _time_us(fn, cuda, calls)
    from benchmarks.graph_timing import REPLAYS

    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(REPLAYS):
        for i in range(calls):
            fn(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / (REPLAYS * calls)


def _syncs(fn) -> str | None:
    """The error torch's sync debug mode raises for one call of fn(0), or None if it syncs nothing."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(0)
    except RuntimeError as e:
        return str(e).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return None


def _bf16_call(x, weights, routes, w13, w2, i):
    from freetoken.kernels.triton.moe_gemm import moe_slots_gemm

    return moe_slots_gemm(x, weights, routes[i], w13, w2)


def _mxfp4_call(gemm, routes, w13, w2, act, down, warps, i):
    return gemm(routes[i], w13, w2, act_blocks=act, down_blocks=down, warps=warps)


def _torch_call(gemm, x, weights, routes, w13, w2, i):
    return gemm(x, weights, routes[i], w13, w2)


def _mxfp4_banks(slots, hidden, inter, bias_dtype):
    """The spec's random banks on the host: (w13 [S, W13], w2 [S, W2]) uint8."""
    import numpy as np

    from freetoken.kernels.specs.mxfp4 import random_projection

    rng = np.random.default_rng(0)
    w13 = random_projection(rng, slots, 2 * inter, hidden, bias_dtype, 0)  # gate_up: 2I rows of H
    w2 = random_projection(rng, slots, hidden, inter, bias_dtype, 0)  # down: H rows of I
    return w13, w2


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest |got - want| over the registered pair's bound (kernels/specs/mxfp4.py)."""
    from freetoken.kernels.registry import REGISTRY

    g = REGISTRY["mxfp4_slots_gemm"].guarantee
    rel = {torch.bfloat16: g.rel, torch.float16: g.fp16_rel}.get(want.dtype, g.fp32_rel)
    got, want = got.cpu().double(), want.double()
    bound = rel * want.abs() + g.abs * want.abs().max()
    diff = (got - want).abs()
    return float(torch.where(diff == 0, 0.0, diff / bound).max())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--inter", type=int, default=2880)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--slots", type=int, default=32, help="slots per bank (enough that calls miss in L2)")
    p.add_argument("--bias", choices=sorted(BIASES), default="bf16", help="the banks' bias dtype")
    p.add_argument("--calls", type=int, default=32, help="captured calls per graph (fresh routes each)")
    p.add_argument("--sweep", action="store_true", help="also try other block shapes and warps")
    p.add_argument("--no-torch", action="store_true", help="skip the torch path (slow at large --tokens)")
    p.add_argument("--out", default=None, help="write the rows as JSON")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported
    from freetoken.kernels.specs.mxfp4 import mxfp4_slots_twin
    from freetoken.kernels.triton.mxfp4_moe_gemm import (
        ACT_BLOCKS,
        DOWN_BLOCKS,
        WARPS,
        mxfp4_slots_gemm,
        projection_bytes,
    )
    from freetoken.moe.mxfp4_format import Mxfp4ExpertFormat

    for tile in SWEEP_ACT + SWEEP_DOWN:
        assert _valid(tile), f"sweep tile {tile}: rows a power of two, columns a power of two >= 32"
    device = "cuda" if cuda else "cpu"
    H, inter, K, N, S = args.hidden, args.inter, args.top_k, args.tokens, args.slots
    bias_dtype = BIASES[args.bias]
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
    rows.append(dict(kernel="moe_slots_gemm bf16", timing="graph", us=us, GBps=distinct * bf16_bytes / us / 1e3))
    print(f"bf16 moe_slots_gemm (reference, no biases): {us:.1f} us, {rows[-1]['GBps']:.0f} GB/s over "
          f"{distinct:.1f} experts x {bf16_bytes / 1e6:.1f} MB", flush=True)
    del w13, w2

    host13, host2 = _mxfp4_banks(S, H, inter, bias_dtype)
    qw13, qw2 = host13.to(device), host2.to(device)
    expert_bytes = projection_bytes(2 * inter, H, bias_dtype)[2] + projection_bytes(H, inter, bias_dtype)[2]
    start = time.perf_counter()
    want = mxfp4_slots_twin(x.cpu(), weights.cpu(), routes[0].cpu(), host13, host2, H, inter, bias_dtype)
    print(f"MXFP4 banks: {S} slots of {expert_bytes / 1e6:.2f} MB an expert ({bf16_bytes / expert_bytes:.2f}x fewer "
          f"than bf16), {args.bias} biases; twin for call 0 in {time.perf_counter() - start:.1f} s", flush=True)
    gemm = functools.partial(mxfp4_slots_gemm, x, weights, hidden=H, inter=inter, bias_dtype=bias_dtype)
    default = (tuple(ACT_BLOCKS), tuple(DOWN_BLOCKS), tuple(WARPS))
    tried, seen = [], {}

    def timed(act, down, warps):
        if (act, down, warps) in seen:  # the default met again in the sweep
            return seen[act, down, warps]
        error = _error(gemm(routes[0], qw13, qw2, act_blocks=act, down_blocks=down, warps=warps), want)
        us = _time_us(functools.partial(_mxfp4_call, gemm, routes, qw13, qw2, act, down, warps), cuda, calls)
        tried.append(dict(kernel="mxfp4_slots_gemm", timing="graph", act_blocks=act, down_blocks=down, warps=warps,
                          us=us, GBps=distinct * expert_bytes / us / 1e3, error_over_bound=error))
        if args.sweep:
            print(f"  act {act} down {down} warps {warps}: {us:.1f} us {tried[-1]['GBps']:.0f} GB/s, "
                  f"error/bound {error:.3g}", flush=True)
        seen[act, down, warps] = us
        return us

    timed(*default)
    first = tried[0]
    print(f"triton mxfp4_slots_gemm (defaults act {default[0]} down {default[1]} warps {default[2]}): "
          f"{first['us']:.1f} us, {first['GBps']:.0f} GB/s, error/bound {first['error_over_bound']:.3g}", flush=True)
    if args.sweep:
        best_act = min(((a, w) for a in SWEEP_ACT for w in SWEEP_WARPS),
                       key=lambda aw: timed(aw[0], default[1], (aw[1], default[2][1])))
        for down, w in itertools.product(SWEEP_DOWN, SWEEP_WARPS):
            timed(best_act[0], down, (best_act[1], w))
        best = min(tried, key=lambda r: r["us"])
        print(f"sweep: best {best['us']:.1f} us {best['GBps']:.0f} GB/s at act {best['act_blocks']} down "
              f"{best['down_blocks']} warps {best['warps']} (error/bound {best['error_over_bound']:.3g}); "
              f"default {first['us']:.1f} us; worst error/bound over the sweep "
              f"{max(r['error_over_bound'] for r in tried):.3g}", flush=True)
    rows += tried

    if not args.no_torch:
        torch_gemm = Mxfp4ExpertFormat(H, inter, bias_dtype).slot_gemm("torch", 0)
        fn = functools.partial(_torch_call, torch_gemm, x, weights, routes, qw13, qw2)
        error = _error(fn(0), want)
        sync = _syncs(fn) if cuda else None
        if sync is None:
            us, timing = _time_us(fn, cuda, calls), "graph" if cuda else "one call (Triton interpreter run)"
        else:
            us, timing = _eager_us(fn, cuda, calls), f"eager, synchronize around the calls (host sync: {sync})"
        rows.append(dict(kernel="mxfp4 torch path (--moe-gemm torch/auto)", timing=timing, us=us,
                         GBps=distinct * expert_bytes / us / 1e3, error_over_bound=error))
        how = timing if sync is None else "eager: host syncs, not capturable; launches included"
        print(f"torch path (dequantize + expert loop, {how}): {us:.1f} us, {rows[-1]['GBps']:.0f} GB/s, "
              f"error/bound {error:.3g} (bf16 roundings; not held to the bound); "
              f"{us / first['us']:.2f}x the Triton default's time", flush=True)
    if args.out:
        gpu = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)"
        json.dump(dict(gpu=gpu, hidden=H, inter=inter, top_k=K, tokens=N, slots=S, bias=args.bias,
                       expert_bytes=expert_bytes, rows=rows), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
