"""What a background slot fill costs the work it overlaps: the MoE GEMM and the CPU expert kernel.

    python -m benchmarks.fill_contention_probe --out fill-contention.json [--programs 8,16,32,64,256]
        [-- BENCH DECODE ARGS]

A background fill (hybrid, graph mode) copies experts for later steps while the step goes on. It
can slow that step twice: its programs hold SMs the step's GEMMs want, and its reads of host
memory compete with the CPU expert kernel's. This times, for qwen3-30b-a3b experts (bf16):
  - the fused MoE GEMM over slots (batch 1, top-8), alone and while a fill of many experts runs
    on another stream: as the fill kernel at each program count per copy, and as DMA copies
    (the copy engine, no SMs);
  - the Numba CPU expert kernel on one expert (decode's usual CPU share of a layer), alone and
    during the same fills;
  - each fill's own rate while it is contended.
Arguments after `--` run `bench decode` once per program count (the background fills' count), in
this process, so the engine's decode is timed at each.
"""

from __future__ import annotations

import datetime
import json
import shlex
import statistics
import sys
import time

import numpy as np
import torch

from benchmarks.slot_fill_probe import decode_at_each_count, probe_arguments
from freetoken.kernels.triton import slot_fill

HIDDEN, INTER, TOP_K = 2048, 768, 8  # qwen3-30b-a3b
FILL_EXPERTS = 48  # long enough to outlast the timed work at every program count


def _gemm_us(x, weights, routes, w13, w2, reps: int) -> float:
    """Mean µs of one MoE GEMM over `reps` back-to-back calls on the current stream."""
    from freetoken.kernels.triton.moe_gemm import moe_slots_gemm

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        moe_slots_gemm(x, weights, routes, w13, w2)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def _cpu_calls_us(banks, fids, until=None, count: int = 60) -> list[float]:
    """µs of CPU expert calls on one fresh expert each; with `until` (an event), only the calls
    that end before it completes (those that overlapped the fill)."""
    from freetoken.kernels.cpu.experts import cpu_moe

    w13, w2 = banks
    x = np.random.default_rng(0).standard_normal((1, HIDDEN), dtype=np.float32)
    weights = np.zeros((1, TOP_K), np.float32)
    weights[0, 0] = 1.0
    out = np.empty((1, HIDDEN), np.float32)
    times = []
    for fid in fids[:count]:
        ids = np.full((1, TOP_K), -1, np.int64)
        ids[0, 0] = fid
        t0 = time.perf_counter()
        cpu_moe(x, weights, ids, w13, w2, out)
        t = (time.perf_counter() - t0) * 1e6
        if until is not None and until.query():
            break
        times.append(t)
    return times


def main(argv: list[str] | None = None) -> int:
    argv, args, decode_args = probe_arguments(argv, __doc__, "8,16,32,64,256", 512,
                                              "experts in the pinned host banks (fresh reads each call)")
    programs = [int(x) for x in args.programs.split(",")]
    host = [torch.empty((args.pool, 2 * INTER, HIDDEN), dtype=torch.bfloat16).pin_memory(),
            torch.empty((args.pool, HIDDEN, INTER), dtype=torch.bfloat16).pin_memory()]
    for h in host:
        h.normal_(0, 0.05)
    cpu_banks = [h.view(torch.int16).numpy().view(np.uint16) for h in host]  # the CPU reads the same pinned pages
    slots = [torch.zeros((TOP_K + FILL_EXPERTS,) + tuple(h.shape[1:]), dtype=torch.bfloat16, device="cuda")
             for h in host]
    expert_bytes = sum(h[0].nbytes for h in host)
    x = torch.randn((1, HIDDEN), dtype=torch.bfloat16, device="cuda")
    weights = torch.full((1, TOP_K), 1.0 / TOP_K, dtype=torch.float32, device="cuda")
    routes = torch.arange(TOP_K, dtype=torch.int32, device="cuda")[None]  # slots the fills never write
    fill_slots = torch.arange(TOP_K, TOP_K + FILL_EXPERTS, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    window = [0]

    def next_fids(n: int) -> list[int]:  # experts no recent call read (the pool is several times L3)
        window[0] = (window[0] + n) % (args.pool - n)
        return list(range(window[0], window[0] + n))

    def start_fill(how: str | int):
        """Launch a fill of FILL_EXPERTS fresh experts on the side stream; returns (start, end) events."""
        fids = torch.tensor(next_fids(FILL_EXPERTS), dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            begin.record()
            if how == "dma":
                for i, f in enumerate(fids.tolist()):
                    for h, s in zip(host, slots, strict=True):
                        s[TOP_K + i].copy_(h[f], non_blocking=True)
            else:
                slot_fill.fill_slots(fill_slots, fids, host, slots, how)
            done.record()
        return begin, done

    for _ in range(3):  # compile and warm both kernels
        _gemm_us(x, weights, routes, *slots, reps=5)
        _cpu_calls_us(cpu_banks, next_fids(4))
        start_fill(64)[1].synchronize()
    rows = []
    for how in ["none", "dma", *programs]:
        gemm, cpu, fill_gbps = [], [], []
        for _ in range(5):
            if how == "none":
                gemm.append(_gemm_us(x, weights, routes, *slots, reps=50))
                cpu += _cpu_calls_us(cpu_banks, next_fids(20), count=20)
                continue
            begin, done = start_fill(how)
            gemm.append(_gemm_us(x, weights, routes, *slots, reps=20))  # well inside the fill
            cpu += _cpu_calls_us(cpu_banks, next_fids(60), until=done)
            done.synchronize()
            fill_gbps.append(FILL_EXPERTS * expert_bytes / (begin.elapsed_time(done) * 1e-3) / 1e9)
        row = {"fill": how if how in ("none", "dma") else f"kernel, {how} programs a copy",
               "gemm_us": statistics.median(gemm), "cpu_expert_us": statistics.median(cpu) if cpu else None,
               "cpu_calls_timed": len(cpu), "fill_GBps": statistics.median(fill_gbps) if fill_gbps else None}
        rows.append(row)
        print(f"[probe] fill {row['fill']:28s} GEMM {row['gemm_us']:7.1f} us  CPU expert "
              f"{row['cpu_expert_us'] or float('nan'):7.1f} us ({len(cpu)} calls)  fill "
              f"{row['fill_GBps'] or float('nan'):5.1f} GB/s", file=sys.stderr)
    result = {"command": "python -m benchmarks.fill_contention_probe " + shlex.join(argv),
              "gpu": torch.cuda.get_device_name(), "expert_bytes": expert_bytes, "fill_experts": FILL_EXPERTS,
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "default_background_programs": slot_fill.BACKGROUND_PROGRAMS_PER_COPY, "results": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    if decode_args:
        del host, slots, cpu_banks
        decode_at_each_count(decode_args, args.out, programs, "BACKGROUND_PROGRAMS_PER_COPY", "background fills")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
