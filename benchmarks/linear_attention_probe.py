"""The linear-attention kernels at Qwen3-Next / Qwen3.5's shapes, against their floors.

    python -m benchmarks.linear_attention_probe --out FILE.json

Shapes: 32 value heads (16 key heads repeated by the caller), DK = DV = 128, conv channels 8192,
W = 4; bf16 inputs, fp32 state. Decode: one token for B sequences, each call on another layer's
pools (256 MB of state cycled, past the L2, as in a step where every layer's state is cold), timed
as a captured step runs it (benchmarks/graph_timing.py). Prefill: one 8k-token sequence, timed with
CUDA events (median of repeats after a warm-up); the token-by-token kernel on the same prefill is
the baseline the chunked pair must beat.

Floors, from rates measured in the same run: bytes that must move (state read and written, inputs
read, outputs written) over a device-to-device copy's bandwidth; and for the chunked prefill the
dot FLOPs of the chunked form (the minimum the WY/UT form needs, not counting the kernel's
recomputation of q k^T per value block) over a dense fp32 matmul's rate with TF32 on, times 3
(the kernels' tf32x3 dots take three TF32 products each).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.cuda_timing import median_event_ms
from benchmarks.graph_timing import CALLS, REPLAYS, graph_us
from freetoken.kernels.triton.causal_conv import causal_conv1d
from freetoken.kernels.triton.gated_delta import CHUNK, gated_delta_chunked, gated_delta_recurrent

HEADS, KEY_DIM, VALUE_DIM, CHANNELS, WIDTH = 32, 128, 128, 8192, 4
STATE_BYTES = HEADS * KEY_DIM * VALUE_DIM * 4  # one sequence's state in one layer


def copy_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_event_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6  # read + write


def tf32_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        ms = median_event_ms(lambda: a @ a)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    return 2 * 8192**3 / ms / 1e9


def _inputs(g: torch.Generator, batch: int, tokens: int):
    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    q, k = (rand(batch, tokens, HEADS, KEY_DIM).bfloat16() for _ in range(2))
    v = rand(batch, tokens, HEADS, VALUE_DIM).bfloat16()
    g_ = -torch.rand(batch, tokens, HEADS, device="cuda", generator=g)
    beta = torch.rand(batch, tokens, HEADS, device="cuda", generator=g).bfloat16()
    return q, k, v, g_, beta


def _io_bytes(batch: int, tokens: int) -> int:
    """q, k, v, beta and out in bf16, g in fp32, the state read and written."""
    per_token = HEADS * (2 * KEY_DIM + 2 * VALUE_DIM + 1) * 2 + HEADS * 4
    return batch * tokens * per_token + 2 * batch * STATE_BYTES


def decode_rows(g: torch.Generator, gbps: float, batch: int) -> list[dict]:
    layers = max(2, min(CALLS, (256 << 20) // (batch * STATE_BYTES)))
    pools = [torch.zeros(batch, HEADS, KEY_DIM, VALUE_DIM, device="cuda") for _ in range(layers)]
    conv_pools = [torch.zeros(batch, CHANNELS, WIDTH - 1, device="cuda").bfloat16() for _ in range(layers)]
    slots = torch.arange(batch, device="cuda")
    q, k, v, g_, beta = _inputs(g, batch, 1)
    x = torch.randn(batch, 1, CHANNELS, device="cuda", generator=g).bfloat16()
    weight = torch.randn(CHANNELS, WIDTH, device="cuda", generator=g).bfloat16()
    cases = {
        "gated_delta_recurrent": (lambda i: gated_delta_recurrent(q, k, v, g_, beta, pools[i % layers], slots),
                                  _io_bytes(batch, 1)),
        "causal_conv": (lambda i: causal_conv1d(x, weight, conv_pools[i % layers], slots),
                        batch * CHANNELS * 2 * (2 + 2 * (WIDTH - 1)) + CHANNELS * WIDTH * 2),
    }
    rows = []
    for name, (fn, nbytes) in cases.items():
        us = graph_us(fn)
        floor = nbytes / gbps / 1e3
        rows.append(dict(phase="decode", kernel=name, batch=batch, us=us, floor_us=floor, over_floor=us / floor))
        print(f"decode {name:22s} B={batch:3d} {us:8.2f} us  floor {floor:7.2f} us  x{us / floor:5.1f}", flush=True)
    return rows


def chunked_flops(tokens: int) -> float:
    """The chunked form's dot FLOPs for one head, summed over its chunks."""
    bt, dk, dv = CHUNK, KEY_DIM, VALUE_DIM
    per_chunk = (bt * bt * dk  # beta k k^T
                 + bt**3 / 3  # the triangular inverse
                 + bt * bt * (dv + dk)  # U and W
                 + 3 * bt * dk * dv  # W S, q S and the state's update k^T v_new
                 + bt * bt * dk + bt * bt * dv)  # q k^T and its product with v_new
    return 2 * per_chunk * -(-tokens // bt)


def prefill_rows(g: torch.Generator, gbps: float, tflops: float, tokens: int) -> list[dict]:
    rows = []
    q, k, v, g_, beta = _inputs(g, 1, tokens)
    pool, slots = torch.zeros(1, HEADS, KEY_DIM, VALUE_DIM, device="cuda"), torch.zeros(1, dtype=torch.int64,
                                                                                      device="cuda")
    x = torch.randn(1, tokens, CHANNELS, device="cuda", generator=g).bfloat16()
    weight = torch.randn(CHANNELS, WIDTH, device="cuda", generator=g).bfloat16()
    conv_pool = torch.zeros(1, CHANNELS, WIDTH - 1, device="cuda").bfloat16()
    byte_floor = _io_bytes(1, tokens) / gbps / 1e6
    flop_floor = HEADS * chunked_flops(tokens) * 3 / (tflops * 1e9)
    cases = {
        "gated_delta_chunked": (lambda: gated_delta_chunked(q, k, v, g_, beta, pool, slots),
                                max(byte_floor, flop_floor)),
        "gated_delta_recurrent": (lambda: gated_delta_recurrent(q, k, v, g_, beta, pool, slots),
                                  max(byte_floor, flop_floor)),
        "causal_conv": (lambda: causal_conv1d(x, weight, conv_pool, slots), 2 * x.numel() * 2 / gbps / 1e6),
    }
    for name, (fn, floor) in cases.items():
        ms = median_event_ms(fn, repeats=3 if name == "gated_delta_recurrent" else 10)
        rows.append(dict(phase="prefill", kernel=name, tokens=tokens, ms=ms, floor_ms=floor, over_floor=ms / floor))
        print(f"prefill {name:22s} T={tokens} {ms:8.3f} ms  floor {floor:7.3f} ms  x{ms / floor:5.1f}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=8192, help="the prefill's length")
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    gbps, tflops = copy_gbps(), tf32_tflops()
    print(f"copy {gbps:.0f} GB/s, fp32 matmul with TF32 {tflops:.0f} TFLOP/s", flush=True)
    rows = [row for batch in (1, 4, 16, 64) for row in decode_rows(g, gbps, batch)]
    rows += prefill_rows(g, gbps, tflops, args.tokens)
    json.dump(dict(command="python -m benchmarks.linear_attention_probe " + " ".join(sys.argv[1:]),
                   gpu=torch.cuda.get_device_name(), copy_GBps=gbps, tf32_TFLOPs=tflops, calls_per_graph=CALLS,
                   replays=REPLAYS, rows=rows), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
