"""Decode-size linear layers and the slot GEMM, timed as a captured step runs them.

    python -m benchmarks.decode_linear_probe --out FILE.json

Each candidate is captured in a CUDA graph CALLS times, cycling through 256 MB of distinct weights
(more than the L2 holds, as in a step, where every layer's weights are cold), and replayed; the time
per call is the replay's over CALLS, so it includes what a captured step pays per launch and no
host launch cost (which `triton.testing.do_bench` adds at these sizes). Shapes: the 16-layer
qwen3-30b-a3b cut's q/k/v projection, output projection and router at 1 and 4 rows, against
cuBLAS (F.linear); the slot GEMM (top-8 of 256 slots) at its block shapes.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch
import torch.nn.functional as F

from benchmarks.graph_timing import CALLS, REPLAYS, graph_us
from freetoken.kernels.triton.decode_linear import decode_linear
from freetoken.kernels.triton.moe_gemm import ACT_BLOCKS, moe_slots_gemm


def _cublas(x, ws, i):
    return F.linear(x, ws[i % len(ws)])


def _triton(x, ws, blocks, i):
    return decode_linear(x, ws[i % len(ws)], None, blocks)


def _gemm(x, weights, routes, w13, w2, act, down, warps, i):
    return moe_slots_gemm(x, weights, routes[i], w13, w2, act_blocks=act or ACT_BLOCKS, down_blocks=down, warps=warps)


def linear_rows(g: torch.Generator) -> list[dict]:
    rows = []
    shapes = {"qkv": (2048, 5120), "o_proj": (4096, 2048), "router": (2048, 128)}
    for name, (k, n) in shapes.items():
        copies = max(2, (256 << 20) // (n * k * 2))  # 256 MB of weights, well past the L2
        ws = [torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16) for _ in range(copies)]
        for m in (1, 4):
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            want = F.linear(x, ws[0])
            variants = {"cublas": functools.partial(_cublas, x, ws)}
            for blocks in [None, (2, 1024, 4), (4, 1024, 4), (8, 512, 4), (4, 512, 4), (8, 256, 4), (16, 256, 8),
                           (1, 2048, 4), (2, 2048, 8), (1, 1024, 2), (1, 2048, 8), (2, 2048, 4), (4, 2048, 8),
                           (1, 4096, 8), (2, 4096, 8), (4, 4096, 16), (8, 1024, 8)]:
                variants[f"triton {blocks or 'default'}"] = functools.partial(_triton, x, ws, blocks)
            for label, fn in variants.items():
                us = graph_us(fn)
                err = (fn(0).float() - want.float()).abs().max().item()
                rows.append(dict(layer=name, rows=m, variant=label, us=us, GBps=n * k * 2 / us / 1e3, max_abs_diff=err))
                print(f"{name:7s} m={m} {label:22s} {us:7.2f} us {n * k * 2 / us / 1e3:7.0f} GB/s", flush=True)
    return rows


def gemm_rows(g: torch.Generator, counts=(1, 4)) -> list[dict]:
    H, inter, S, K = 2048, 768, 256, 8
    w13 = (torch.randn(S, 2 * inter, H, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(S, H, inter, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    expert_bytes = (w13[0].numel() + w2[0].numel()) * 2
    rows = []
    for n in counts:
        x = torch.randn(n, H, device="cuda", generator=g).to(torch.bfloat16)
        weights = torch.rand(n, K, device="cuda", generator=g)
        routes = [torch.stack([torch.randperm(S, device="cuda", generator=g)[:K] for _ in range(n)]).int()
                  for _ in range(CALLS)]
        distinct = len(set(routes[0].flatten().tolist()))
        # the down kernel's blocks and warps at the default act blocks, then the act kernel's
        sweep = [(None, down, warps) for down in [None, (2, 1024), (4, 1024), (4, 512), (8, 256), (1, 1024),
                                                  (2, 512), (2, 256), (4, 256), (1, 512), (16, 128)]
                 for warps in [(2, 1), (2, 2), (2, 4), (4, 4), (4, 8)]]
        sweep += [(act, None, warps) for act in [(2, 1024), (8, 1024), (4, 2048), (8, 512), (4, 512), (16, 256)]
                  for warps in [(1, 4), (2, 4), (4, 4), (8, 4)]]
        for act, down, warps in sweep:
            us = graph_us(functools.partial(_gemm, x, weights, routes, w13, w2, act, down, warps))
            label = f"act {act or 'default'} down {down or 'default'} warps {warps}"
            rows.append(dict(layer="moe_slots_gemm", rows=n, variant=label, us=us,
                             GBps=distinct * expert_bytes / us / 1e3))
            print(f"gemm    m={n} {label}: {us:7.2f} us", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--only", choices=["linear", "gemm"], default=None)
    p.add_argument("--gemm-rows", default="1,4", help="the slot GEMM's token counts, comma-separated")
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = [int(c) for c in args.gemm_rows.split(",")]
    rows = (linear_rows(g) if args.only != "gemm" else []) + (gemm_rows(g, counts) if args.only != "linear" else [])
    json.dump(dict(command="python -m benchmarks.decode_linear_probe " + " ".join(sys.argv[1:]),
                   gpu=torch.cuda.get_device_name(), calls_per_graph=CALLS, replays=REPLAYS, rows=rows),
              open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
