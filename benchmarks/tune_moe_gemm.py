"""Block shapes of the slot GEMM's two kernels at decode sizes, timed on the GPU.

    python -m benchmarks.tune_moe_gemm --out FILE.json

A decode step reads each routed expert's weights once (w13 then w2), so both kernels are
memory-bound: the table gives each configuration's time and effective bandwidth (expert bytes
over time) at batch 1 and 4, top-8, timed inside CUDA graphs (benchmarks/graph_timing.py) with a
fresh draw of experts for every captured call. (Before 2026-11-30 this script timed with
`triton.testing.do_bench`, whose host launches dominate at these sizes: `tune-moe-gemm-h200.json`
and `tune-moe-gemm-23deafb-h200.json` came from that.)
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch

from benchmarks.graph_timing import CALLS, graph_us
from freetoken.kernels.triton.moe_gemm import moe_slots_gemm


def _gemm(x, weights, routes, w13, w2, act, down, warps, i):
    return moe_slots_gemm(x, weights, routes[i], w13, w2, act, down, warps)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    H, inter, S, K = args.hidden, args.inter, args.slots, args.top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(S, 2 * inter, H, device="cuda", generator=g).to(torch.bfloat16) * 0.02
    w2 = torch.randn(S, H, inter, device="cuda", generator=g).to(torch.bfloat16) * 0.02
    expert_bytes = (w13[0].numel() + w2[0].numel()) * 2
    rows = []
    for n in (1, 4):
        x = torch.randn(n, H, device="cuda", generator=g).to(torch.bfloat16)
        weights = torch.rand(n, K, device="cuda", generator=g).to(torch.bfloat16)
        # a fresh draw of experts for every captured call, as a step's layers route
        routes = [torch.stack([torch.randperm(S, device="cuda", generator=g)[:K] for _ in range(n)]).int()
                  for _ in range(CALLS)]
        distinct = len(set(routes[0].flatten().tolist()))
        want = moe_slots_gemm(x, weights, routes[0], w13, w2)
        for act, down, warps in itertools.product([(8, 512), (16, 256), (4, 1024), (8, 256)],
                                                  [(16, 256), (8, 256), (4, 256), (8, 512), (4, 512), (2, 1024)],
                                                  [(4, 4), (2, 4), (4, 2), (8, 8)]):
            fn = functools.partial(_gemm, x, weights, routes, w13, w2, act, down, warps)
            got = fn(0)
            us = graph_us(fn)
            rows.append(dict(n=n, act_blocks=act, down_blocks=down, warps=warps, us=us,
                             GBps=distinct * expert_bytes / us / 1e3, equal=bool(torch.equal(got, want))))
        best = min((r for r in rows if r["n"] == n), key=lambda r: r["us"])
        print(f"n={n}: best {best}", flush=True)
    json.dump(dict(gpu=torch.cuda.get_device_name(), hidden=H, inter=inter, top_k=K, rows=rows),
              open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
