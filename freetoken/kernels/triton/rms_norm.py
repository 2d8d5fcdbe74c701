"""Fused RMSNorm (optionally after the residual add): one kernel instead of the reference's
chain of elementwise kernels.

Shape legend: R rows (every leading dimension flattened), H the normalised width.
Twins: `freetoken.reference.norms.rms_norm` and `add_rms_norm` (the reference semantics), and
the families' variants there: rounded once (gpt_oss), zero-centred weights (Qwen3-Next / 3.5),
gated by silu (the Gated DeltaNet's output norm); the residual add rounds once, as the tensor add
does, so the sum is bit-exact. Rounding points are
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
def _rms_norm_kernel(x_ptr, res_ptr, sum_ptr, w_ptr, gate_ptr, out_ptr, H, eps,
                     BLOCK_H: tl.constexpr, OUT_BF16: tl.constexpr, ADD: tl.constexpr, ONCE: tl.constexpr,
                     OFFSET: tl.constexpr, GATE: tl.constexpr, PDL: tl.constexpr):
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
    if OFFSET:  # a zero-centred weight: the norm scales by 1 + w, that sum in fp32
        w = w + 1.0
    if OUT_BF16 and not ONCE:
        y = rne_bf16(y).to(tl.float32)  # the twin rounds to the activation dtype before the weight
    y = w * y
    if GATE:  # the Gated DeltaNet's output norm: the normed row, rounded, times silu(gate) in fp32
        if OUT_BF16:
            y = rne_bf16(y).to(tl.float32)
        else:
            y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        gate = tl.load(gate_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
        y = y * (gate / (1.0 + tl.exp(-gate)))
    if OUT_BF16:
        tl.store(out_ptr + row * H + offs, rne_bf16(y), mask=mask)
    else:
        tl.store(out_ptr + row * H + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, once: bool = False,
            offset: bool = False, gate: torch.Tensor | None = None):
    h = x.shape[-1]
    if weight.shape != (h,) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{h}] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"fused_rms_norm takes bfloat16 or float32, got {x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    if gate is not None and (gate.shape != x.shape or gate.dtype != x.dtype):
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} must match x {tuple(x.shape)} {x.dtype}")
    flat = x.reshape(-1, h).contiguous()  # [R, H]
    res = residual.reshape(-1, h).contiguous() if residual is not None else flat
    gates = gate.reshape(-1, h).contiguous() if gate is not None else flat
    total = torch.empty_like(flat) if residual is not None else flat
    out = torch.empty_like(flat)
    block = triton.next_power_of_2(h)
    _rms_norm_kernel[(flat.shape[0],)](flat, res, total, weight, gates, out, h, eps, BLOCK_H=block,
                                       OUT_BF16=x.dtype == torch.bfloat16, ADD=residual is not None, ONCE=once,
                                       OFFSET=offset, GATE=gate is not None,
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


def fused_rms_norm_rounded_once(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Twin: `rms_norm_rounded_once` (gpt_oss): the weight applied in fp32, one rounding."""
    return _launch(x, None, weight, eps, once=True)[1]


def fused_add_rms_norm_rounded_once(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin: `add_rms_norm_rounded_once`."""
    return _launch(x, residual, weight, eps, once=True)


def fused_offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Twin: `offset_rms_norm` (qwen3_next, qwen3_5: zero-centred weights, scaled by 1 + w in fp32)."""
    return _launch(x, None, weight, eps, once=True, offset=True)[1]


def fused_offset_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin: `offset_add_rms_norm`."""
    return _launch(x, residual, weight, eps, once=True, offset=True)


def fused_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Twin: `gated_rms_norm` (the Gated DeltaNet's output norm): x, gate [..., H] -> [..., H]."""
    return _launch(x, None, weight, eps, gate=gate)[1]
