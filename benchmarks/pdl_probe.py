"""What programmatic dependent launch (PDL) saves a captured decode step, before any engine
kernel uses it.

A decode step is a chain of small dependent kernels: each starts only after the one before it
has finished and its writes are flushed, so every boundary pays the next kernel's launch and
ramp on an idle device. With PDL (Hopper and later) a kernel launched with the programmatic
stream-serialization attribute may start while its predecessor drains; it calls
`griddepcontrol.wait` before it reads what the predecessor wrote. What it reads that nobody
writes (dense weights) it may load before the wait.

The probe times, inside one CUDA graph, 16 "layers" of the shapes a qwen3-30b-a3b decode step
runs at batch 1 (a norm, the qkv projection [5120, 2048], a small elementwise kernel, the
o-projection [2048, 4096], a norm), each layer with its own weights (so nothing is served from
L2), in five variants:
  plain      no PDL;
  wait       PDL, every kernel waits first thing;
  prefetch   PDL, the projections load their weight rows before the wait;
  signal     PDL, every kernel signals its dependents as it starts, then waits (what the
             engine's kernels do: kernels/triton/pdl.py);
  trigger    as prefetch, and every kernel signals its dependents as it starts.
Every variant's output must equal the plain one's bit for bit (same arithmetic).

Run: python -m benchmarks.pdl_probe --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

HIDDEN, QKV, ATTN = 2048, 5120, 4096


@triton.jit
def _norm(x_ptr, w_ptr, out_ptr, H: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr):
    offs = tl.arange(0, H)
    w = tl.load(w_ptr + offs).to(tl.float32)
    if TRIGGER:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()
    x = tl.load(x_ptr + offs).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / H + 1e-6)
    tl.store(out_ptr + offs, (x * r * w).to(tl.bfloat16))


@triton.jit
def _scale(x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if TRIGGER:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()
    x = tl.load(x_ptr + offs, mask=offs < N).to(tl.float32)
    tl.store(out_ptr + offs, (x * 0.5).to(tl.bfloat16), mask=offs < N)


@triton.jit
def _gemv(x_ptr, w_ptr, out_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
          PREFETCH: tl.constexpr, TRIGGER: tl.constexpr):
    n_offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_offs = tl.arange(0, K)
    rows = w_ptr + n_offs.to(tl.int64)[:, None] * K + k_offs[None, :]
    if TRIGGER:
        gdc_launch_dependents()
    if PREFETCH:
        w = tl.load(rows)
        if PDL:
            gdc_wait()
    else:
        if PDL:
            gdc_wait()
        w = tl.load(rows)
    x = tl.load(x_ptr + k_offs).to(tl.float32)
    tl.store(out_ptr + n_offs, tl.sum(w.to(tl.float32) * x[None, :], axis=1).to(tl.bfloat16))


VARIANTS = {  # name: (pdl, prefetch, trigger)
    "plain": (False, False, False),
    "wait": (True, False, False),
    "prefetch": (True, True, False),
    "signal": (True, False, True),
    "trigger": (True, True, True),
}


def step(x, layers, bufs, pdl, prefetch, trigger):
    a, b, c, d = bufs
    for norm_w, qkv_w, o_w, norm2_w in layers:
        _norm[(1,)](x, norm_w, a, H=HIDDEN, PDL=pdl, TRIGGER=trigger, launch_pdl=pdl, num_warps=8)
        _gemv[(QKV // 2,)](a, qkv_w, b, QKV, K=HIDDEN, BLOCK_N=2, PDL=pdl, PREFETCH=prefetch, TRIGGER=trigger,
                           launch_pdl=pdl, num_warps=4)
        _scale[(ATTN // 1024,)](b, c, N=ATTN, BLOCK=1024, PDL=pdl, TRIGGER=trigger, launch_pdl=pdl, num_warps=4)
        _gemv[(HIDDEN // 2,)](c, o_w, d, HIDDEN, K=ATTN, BLOCK_N=2, PDL=pdl, PREFETCH=prefetch, TRIGGER=trigger,
                              launch_pdl=pdl, num_warps=8)
        _norm[(1,)](d, norm2_w, x, H=HIDDEN, PDL=pdl, TRIGGER=trigger, launch_pdl=pdl, num_warps=8)


def run(variant: str, layers, x0, replays: int) -> tuple[float, torch.Tensor]:
    pdl, prefetch, trigger = VARIANTS[variant]
    x = x0.clone()
    bufs = [torch.empty(n, dtype=torch.bfloat16, device="cuda") for n in (HIDDEN, QKV, ATTN, HIDDEN)]
    step(x, layers, bufs, pdl, prefetch, trigger)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.copy_(x0)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            step(x, layers, bufs, pdl, prefetch, trigger)
    x.copy_(x0)
    graph.replay()
    torch.cuda.synchronize()
    out = x.clone()
    times = []
    for _ in range(replays):
        x.copy_(x0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    return times[len(times) // 2], out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device="cuda") * 0.05).to(torch.bfloat16)

    layers = [(rnd(HIDDEN) + 1, rnd(QKV, HIDDEN), rnd(HIDDEN, ATTN), rnd(HIDDEN) + 1) for _ in range(args.layers)]
    x0 = rnd(HIDDEN) * 20
    weight_bytes = sum(t.nbytes for layer in layers for t in layer)
    rows, reference = [], None
    for r in range(args.rounds):
        for variant in VARIANTS:
            us, out = run(variant, layers, x0, args.replays)
            if reference is None:
                reference = out
            rows.append({"round": r, "variant": variant, "us_per_step": us,
                         "us_per_layer": us / args.layers, "GBps": weight_bytes / us / 1e3,
                         "equal_to_plain": bool(torch.equal(out, reference))})
            print(json.dumps(rows[-1]))
    result = {
        "command": "python -m benchmarks.pdl_probe --out OUT.json",
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "layers": args.layers, "replays": args.replays, "weight_bytes_per_step": weight_bytes,
        "kernels_per_layer": 5, "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
