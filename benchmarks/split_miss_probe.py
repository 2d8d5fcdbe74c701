"""What a split miss costs its two sides on this machine: the CPU kernel on whole experts and
on a split one's rows [0, c), and the fill kernel on whole experts and on a split's GPU rows.

    python -m benchmarks.split_miss_probe OUT.json

qwen3-30b-a3b's expert shape (H 2048, I 768), random bf16 banks of 256 experts, one token,
15 CPU threads; medians in microseconds. Each fill timing is CUDA events around `fill_slots`,
so it includes the launch's host time (the device waits for it). Results:
benchmarks/results/split-miss-probe-*-h200.json (docs/lab/decode-rounds.md, split misses).
"""

from __future__ import annotations

import json
import sys
import time

import numba
import numpy as np
import torch

from freetoken.kernels.cpu.experts import cpu_moe
from freetoken.kernels.triton.slot_fill import fill_slots
from freetoken.reference.expert_cache import pack_split_id

H, I, E = 2048, 768, 256


def _cpu_us(x, w13, w2, cpu_rows: list[int], reps: int = 60) -> float:
    """One token routed to len(cpu_rows) experts, each whole (0) or split at that many CPU rows."""
    out = np.zeros_like(x)
    times = []
    for r in range(reps):
        base = (r * 9) % (E - 8)  # fresh experts each call
        ids = np.array([[pack_split_id(base + j, c) for j, c in enumerate(cpu_rows)]], np.int32)
        weights = np.ones(ids.shape, np.float32)
        t0 = time.perf_counter()
        cpu_moe(x, weights, ids, w13, w2, out)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[5:])) * 1e6


def _fill_us(banks, slots, copies: list[tuple[int, int]], split: list[int] | None, reps: int = 50) -> float:
    """Whole copies (slot, fid) and optionally a split row (slot, fid, c, I - c), fresh fids each rep."""
    pad = [-1] * (8 - len(copies))
    copy_slots = torch.tensor([c[0] for c in copies] + pad, dtype=torch.int32, device="cuda")
    copy_fids = torch.tensor([c[1] for c in copies] + pad, dtype=torch.int32, device="cuda")
    split_t = torch.tensor(split, dtype=torch.int32, device="cuda") if split else None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for r in range(reps):
        if copies:
            copy_fids.copy_(torch.tensor([(c[1] + r * 3) % E for c in copies] + pad, dtype=torch.int32))
        if split:
            split_t[1] = (split[1] + r * 5) % E
        torch.cuda.synchronize()
        start.record()
        fill_slots(copy_slots, copy_fids, banks, slots, split=split_t)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return float(np.median(times[5:]))


def main(out_path: str) -> None:
    numba.set_num_threads(15)
    rng = np.random.default_rng(0)
    w13 = (rng.standard_normal((E, 2 * I, H), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    w2 = (rng.standard_normal((E, H, I), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    x = rng.standard_normal((1, H), dtype=np.float32)
    res = {}
    for name, rows in {"1 whole": [0], "2 whole": [0, 0], "split c=384": [384], "split c=448": [448],
                       "split c=128": [128], "1 whole + split c=448": [0, 448],
                       "2 whole + split 448": [0, 0, 448]}.items():
        res["cpu_us " + name] = _cpu_us(x, w13, w2, rows)
    banks = [torch.from_numpy(w13.view(np.int16)).view(torch.bfloat16).pin_memory(),
             torch.from_numpy(w2.view(np.int16)).view(torch.bfloat16).pin_memory()]
    slots = [torch.zeros(4, 2 * I, H, dtype=torch.bfloat16, device="cuda"),
             torch.zeros(4, H, I, dtype=torch.bfloat16, device="cuda")]
    res["fill_us 1 whole"] = _fill_us(banks, slots, [(0, 1)], None)
    res["fill_us 2 whole"] = _fill_us(banks, slots, [(0, 1), (1, 2)], None)
    for c in (128, 384, 448, 640):
        res[f"fill_us split gpu rows {I - c}"] = _fill_us(banks, slots, [], [3, 7, c, I - c])
        res[f"fill_us 1 whole + split gpu rows {I - c}"] = _fill_us(banks, slots, [(0, 1)], [3, 7, c, I - c])
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
