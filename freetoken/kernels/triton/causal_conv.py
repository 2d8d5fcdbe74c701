"""The causal depthwise convolution + SiLU before Qwen3-Next / Qwen3.5's linear attention, with
the conv state kept in a slot pool and updated in place (decode steps and prefill chunks alike).

Shape legend: B sequences, T tokens per sequence, C channels, W taps, S state slots.
Twin: `freetoken.reference.causal_conv.causal_conv1d`; pair in kernels/specs/linear_attention.py.
Rounding points are the twin's: the W products summed in fp32 in tap order, rounded to x's dtype,
SiLU in fp32, rounded again (the GPU may fuse a product into the sum, a last-bit difference).

One program per (sequence, channel block, token block) reads each input tap straight from x or,
before the sequence's first token, from the pool; the program holding the last token block
writes the new state (the last W-1 inputs). With more than one token block another program could
overwrite the state before the first block has read it, so that case reads a copy of the old
state taken first; one token block (every decode step) reads the pool itself and launches once,
which keeps a captured step free of the copy. The slots one call writes must be distinct; a negative
slot -(s + 1) is a read-only row (reference/gated_delta.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton.rounding import round_activation, store_rounded
from freetoken.reference.causal_conv import check_causal_conv_inputs
from freetoken.reference.gated_delta import read_slots


@triton.jit
def _input_at(x_ptr, old_ptr, b, old_row, offs_p, offs_c, mask_c, T, C, sx_b, sx_t, WM1: tl.constexpr):
    """The inputs at positions offs_p [P] of the sequence (negative: the old state's) -> [P, BLOCK_C] fp32."""
    in_x = (offs_p >= 0) & (offs_p < T)
    from_x = tl.load(x_ptr + b * sx_b + offs_p[:, None] * sx_t + offs_c[None, :],
                     mask=in_x[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
    in_old = offs_p < 0
    from_old = tl.load(old_ptr + (old_row * C + offs_c[None, :]) * WM1 + (WM1 + offs_p[:, None]),
                       mask=in_old[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
    return tl.where(in_old[:, None], from_old, from_x)


@triton.jit
def _causal_conv_kernel(x_ptr, w_ptr, old_ptr, old_rows_ptr, pool_ptr, slots_ptr, out_ptr, T, C, sx_b, sx_t,
                        W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
                        BF16: tl.constexpr):
    WM1: tl.constexpr = W - 1
    b = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_c = offs_c < C
    old_row = tl.load(old_rows_ptr + b)
    old_row = tl.where(old_row < 0, -old_row - 1, old_row)  # (a read-only row's slot, -(s + 1))
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(W):  # tap j reads the input W-1-j positions back
        weight = tl.load(w_ptr + offs_c * W + j, mask=mask_c, other=0.0).to(tl.float32)
        acc += weight[None, :] * _input_at(x_ptr, old_ptr, b, old_row, offs_t - (WM1 - j), offs_c, mask_c, T, C,
                                           sx_b, sx_t, WM1)
    z = round_activation(acc, BF16)
    y = z / (1.0 + tl.exp(-z))
    store_rounded(out_ptr + (b * T + offs_t[:, None]) * C + offs_c[None, :], y,
                  (offs_t[:, None] < T) & mask_c[None, :], BF16)
    if (tl.program_id(2) + 1) * BLOCK_T >= T:  # the last token block: the new state, the last W-1 inputs
        offs_s = tl.arange(0, BLOCK_W)
        kept = _input_at(x_ptr, old_ptr, b, old_row, T - WM1 + offs_s, offs_c, mask_c, T, C, sx_b, sx_t, WM1)
        slot = tl.load(slots_ptr + b)  # (negative: a read-only row, which writes nothing)
        store_rounded(pool_ptr + (tl.maximum(slot, 0) * C + offs_c[None, :]) * WM1 + offs_s[:, None], kept,
                      (offs_s[:, None] < WM1) & mask_c[None, :] & (slot >= 0), BF16)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor,
                  slots: torch.Tensor) -> torch.Tensor:
    """x [B, T, C] (bf16 or fp32); weight [C, W]; conv_pool [S, C, W-1] of x's dtype, rows `slots`
    [B] (those written distinct; negative: read-only) read then overwritten -> y [B, T, C] in x's dtype."""
    check_causal_conv_inputs(x, weight, conv_pool, slots)
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"causal_conv1d: x is {x.dtype}; bfloat16 or float32 expected")
    if x.stride(2) != 1 or not weight.is_contiguous() or not conv_pool.is_contiguous():
        raise ValueError("causal_conv1d: x's channels, weight and conv_pool must be contiguous")
    devices = {t.device for t in (x, weight, conv_pool, slots)}
    if len(devices) != 1:
        raise ValueError(f"causal_conv1d: the arguments are on several devices {sorted(map(str, devices))}")
    B, T, C = x.shape
    W = weight.shape[1]
    block_t = min(64, triton.next_power_of_2(T))
    token_blocks = triton.cdiv(T, block_t)
    if token_blocks == 1:
        old, old_rows = conv_pool, slots
    else:
        old, old_rows = conv_pool[read_slots(slots)], torch.arange(B, device=x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [B, T, C]
    block_c = 256 if token_blocks == 1 else 64
    _causal_conv_kernel[(B, triton.cdiv(C, block_c), token_blocks)](
        x, weight, old, old_rows, conv_pool, slots, out, T, C, x.stride(0), x.stride(1), W=W, BLOCK_C=block_c,
        BLOCK_T=block_t, BLOCK_W=triton.next_power_of_2(W - 1), BF16=x.dtype == torch.bfloat16, num_warps=4)
    return out
