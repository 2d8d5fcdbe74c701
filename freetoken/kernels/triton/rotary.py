"""Fused rotary embedding: one kernel for `Rotary.apply` (the reference's neg, cat, two
multiplies and an add).

Shape legend: B sequences, T tokens, Hh heads, D head dim (even).
Twin: `freetoken.reference.rotary.Rotary.apply`, equal bit for bit: the same three roundings
to the activation dtype (x * cos, rotated * sin, their sum), computed from widened values; in
fp32 the multiply-add is not fused, since the twin rounds the product before the sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton.rounding import round_activation, store_rounded


@triton.jit
def normed_rotated(row_ptr, d, partner, mask, w_ptr, c, s, r, ROT, NORM: tl.constexpr, BF16: tl.constexpr,
                   OFFSET: tl.constexpr = False):
    """One head row: optional RMSNorm by the factor r (rounded as the twin rounds; with OFFSET the
    weight is stored zero-centred: times (1 + w) in fp32, rounded once), then the rotary embedding
    over the row's first ROT dims with cos/sin values c, s (three roundings, no fused
    multiply-add); dims from ROT on keep the normed value. `partner` pairs d with d +- ROT/2."""
    half = ROT // 2
    x = tl.load(row_ptr + d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row_ptr + partner, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=mask, other=0.0).to(tl.float32)
        if OFFSET:
            x = round_activation(x * r * (1.0 + w), BF16)
            xp = round_activation(xp * r * (1.0 + wp), BF16)
        else:
            x = round_activation(w * round_activation(x * r, BF16), BF16)
            xp = round_activation(wp * round_activation(xp * r, BF16), BF16)
    rotated = tl.where(d < half, -xp, xp)
    turned = round_activation(x * c, BF16) + round_activation(rotated * s, BF16)  # rounded by the store
    return tl.where(d < ROT, turned, x)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, D, BLOCK_D: tl.constexpr, BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one (b, t, head)
    token = row // heads
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    partner = tl.where(d < D // 2, d + D // 2, d - D // 2)
    c = tl.load(cos_ptr + token * D + d, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + token * D + d, mask=mask, other=0.0).to(tl.float32)
    y = normed_rotated(x_ptr + row * D, d, partner, mask, x_ptr, c, s, 1.0, D, False, BF16)
    store_rounded(out_ptr + row * D + d, y, mask, BF16)


def fused_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, Hh, D], cos/sin [B, T, D] of x's dtype (bf16 or fp32) -> [B, T, Hh, D]."""
    B, T, heads, D = x.shape
    if cos.shape != (B, T, D) or sin.shape != (B, T, D) or D % 2:
        raise ValueError(f"x {tuple(x.shape)} needs cos/sin [{B}, {T}, {D}] and an even D")
    if x.dtype not in (torch.bfloat16, torch.float32) or cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ValueError(f"fused_rotary takes bfloat16 or float32 throughout, got {x.dtype}/{cos.dtype}")
    x = x.contiguous()
    out = torch.empty_like(x)
    _rotary_kernel[(B * T * heads,)](x, cos.contiguous(), sin.contiguous(), out, heads, D,
                                     BLOCK_D=triton.next_power_of_2(D), BF16=x.dtype == torch.bfloat16,
                                     num_warps=1, enable_fp_fusion=False)  # no FMA: the twin rounds x*cos
    return out
