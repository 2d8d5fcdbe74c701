"""The router at decode sizes, timed as a captured step runs it: its logits and routing as two
launches (decode_linear, then fused_route) against one (decode_router) at several warp counts.

    python -m benchmarks.router_probe --out FILE.json

Shape: the qwen3-30b-a3b router (2048 -> 128 experts, top-8, renormalised) at 1, 2 and 4 rows,
over 256 MB of distinct router weights (every layer's router is cold in a step), timed inside a
CUDA graph (benchmarks/graph_timing.py).
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from benchmarks.graph_timing import CALLS, REPLAYS, graph_us
from freetoken.kernels.triton.decode_linear import decode_linear
from freetoken.kernels.triton.decode_router import decode_router
from freetoken.kernels.triton.routing import fused_route

TOP_K = 8


def _two_launches(x, ws, i):
    return (None, *fused_route(decode_linear(x, ws[i % len(ws)]), TOP_K, True, False))


def _one_launch(x, ws, blocks, i):
    return decode_router(x, ws[i % len(ws)], TOP_K, True, False, blocks)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, experts = 2048, 128
    copies = (256 << 20) // (hidden * experts * 2)
    ws = [(torch.randn(experts, hidden, device="cuda", generator=g) / hidden**0.5).to(torch.bfloat16)
          for _ in range(copies)]
    rows = []
    for m in (1, 2, 4):
        x = torch.randn(m, hidden, device="cuda", generator=g).to(torch.bfloat16)
        want_ids = _two_launches(x, ws, 0)[2]
        variants = {"two launches": functools.partial(_two_launches, x, ws)}
        for blocks in [None, (1, 2048, 1), (1, 2048, 2), (1, 2048, 4), (2, 2048, 8), (2, 2048, 2), (4, 2048, 4)]:
            variants[f"one launch {blocks or 'default'}"] = functools.partial(_one_launch, x, ws, blocks)
        for label, fn in variants.items():
            us = graph_us(fn)
            same = bool(torch.equal(fn(0)[2], want_ids))
            rows.append(dict(rows=m, variant=label, us=us, same_experts=same))
            print(f"m={m} {label:28s} {us:6.2f} us  same experts: {same}", flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(command="python -m benchmarks.router_probe --out FILE", gpu=torch.cuda.get_device_name(),
                       calls_per_graph=CALLS, replays=REPLAYS, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
