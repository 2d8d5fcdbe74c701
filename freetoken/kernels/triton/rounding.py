"""Rounding to the activation dtype inside Triton kernels, shared by every kernel that stores
bf16: the interpreter's fp32 -> bf16 cast truncates, so kernels round on the bits themselves,
the way the hardware cast (and hence every torch twin) rounds: to nearest, ties to even.

Twin: torch's CPU cast `x.to(torch.bfloat16)`, equal bit for bit except NaN payloads (the
"bf16_round" pair in kernels/specs/hierarchy.py, through `round_to_bf16`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rne_bf16(x):
    """fp32 -> bf16 with round-to-nearest-even on the bits (the interpreter's cast truncates)."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0, r)  # any NaN -> the canonical quiet NaN
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def round_activation(x, BF16: tl.constexpr):
    """x fp32 -> the activation dtype's value, kept in fp32 for the next operation."""
    if BF16:
        return rne_bf16(x).to(tl.float32)
    return x


@triton.jit
def store_rounded(ptr, value, mask, OUT_BF16: tl.constexpr):
    """Store fp32 `value` at `ptr` in the pointer's dtype, bf16 through `rne_bf16`."""
    if OUT_BF16:
        tl.store(ptr, rne_bf16(value), mask=mask)
    else:
        tl.store(ptr, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    store_rounded(out_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask, True)


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """x fp32 (any shape) -> bf16 through `rne_bf16`; exposes the helper for its tests."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    block = 1024
    _round_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), BLOCK=block)
    return out
