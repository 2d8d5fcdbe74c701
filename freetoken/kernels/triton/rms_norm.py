"""Fused RMSNorm (optionally after the residual add): one kernel instead of the reference's
chain of elementwise kernels.

Shape legend: R rows (every leading dimension flattened), H the normalised width.
Twins: `freetoken.reference.norms.rms_norm` and `add_rms_norm` (the reference semantics); the
residual add rounds once, as the tensor add does, so the sum is bit-exact. Rounding points are
the twin's: x widened to fp32, x * rsqrt(mean(x^2) + eps) rounded to the activation dtype,
then times the weight and rounded again. Only the order of the sum of squares (and rsqrt's last
bit) differ, so outputs agree within one unit in the last place of the activation dtype
(registered in kernels/specs/dense.py). The reference's chain is ~9 launches per norm (and one more
for the residual add): each launch has a fixed cost inside a CUDA graph, so that chain was most of
a decode layer's non-GEMM time. The q/k norms of the fused decode path run inside
kernels/triton/decode_attention.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton import pdl
from freetoken.kernels.triton.rounding import rne_bf16


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, sum_ptr, w_ptr, out_ptr, H, eps,
                     BLOCK_H: tl.constexpr, OUT_BF16: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD:  # the residual sum first, rounded to the activation dtype as a tensor add rounds it
        x += tl.load(res_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
        if OUT_BF16:
            x = rne_bf16(x).to(tl.float32)
            tl.store(sum_ptr + row * H + offs, rne_bf16(x), mask=mask)
        else:
            tl.store(sum_ptr + row * H + offs, x.to(sum_ptr.dtype.element_ty), mask=mask)
    var = tl.sum(x * x, axis=0) / H
    y = x * (1.0 / tl.sqrt_rn(var + eps))
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if OUT_BF16:
        y = rne_bf16(y).to(tl.float32)  # the twin rounds to the activation dtype before the weight
        tl.store(out_ptr + row * H + offs, rne_bf16(w * y), mask=mask)
    else:
        tl.store(out_ptr + row * H + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    h = x.shape[-1]
    if weight.shape != (h,) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{h}] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"fused_rms_norm takes bfloat16 or float32, got {x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    flat = x.reshape(-1, h).contiguous()  # [R, H]
    res = residual.reshape(-1, h).contiguous() if residual is not None else flat
    total = torch.empty_like(flat) if residual is not None else flat
    out = torch.empty_like(flat)
    block = triton.next_power_of_2(h)
    _rms_norm_kernel[(flat.shape[0],)](flat, res, total, weight, out, h, eps, BLOCK_H=block,
                                       OUT_BF16=x.dtype == torch.bfloat16, ADD=residual is not None,
                                       num_warps=1 if block <= 256 else 4 if block <= 2048 else 8, **pdl.launch(flat))
    return total.view(x.shape), out.view(x.shape)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] (bf16 or fp32), weight [H] of x's dtype -> [..., H] in x's dtype."""
    return _launch(x, None, weight, eps)[1]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's add and the next norm in one kernel (twin: `add_rms_norm`):
    x, residual [..., H] -> (x + residual, rms_norm(x + residual))."""
    return _launch(x, residual, weight, eps)
