"""Reference semantics of RMSNorm, alone and after the residual add (twins of
kernels/triton/rms_norm.py and of the norms inside kernels/triton/{norm_linear,decode_attention}.py).

Rounding points follow the Hugging Face implementations: x widened to fp32, x * rsqrt(mean(x^2)
+ eps) rounded to the activation dtype, then times the weight in that dtype. gpt-oss's and the
zero-centred norms instead multiply by the weight in fp32 and round once (`rms_norm_rounded_once`).
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(var + eps)).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add, then the norm of the sum -> (sum, normed sum)."""
    total = x + residual
    return total, rms_norm(total, weight, eps)


def rms_norm_rounded_once(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) times the weight, all in fp32, rounded once to x's dtype: gpt-oss's
    RMSNorm in transformers (its weight promoted to fp32 by the fp32 normed x)."""
    x32 = x.float()
    return ((x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)) * weight.float()).to(x.dtype)


def add_rms_norm_rounded_once(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return total, rms_norm_rounded_once(total, weight, eps)


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of a weight stored zero-centred (qwen3_next, qwen3_5): `rms_norm_rounded_once` by
    (1 + weight), that sum taken in fp32, as transformers computes it."""
    return rms_norm_rounded_once(x, 1.0 + weight.float(), eps)


def offset_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return total, offset_rms_norm(total, weight, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Gated DeltaNet's output norm: RMSNorm of x (its weight not zero-centred), rounded to
    x's dtype and scaled by the weight, then times silu(gate) in fp32, rounded to x's dtype."""
    x32 = x.float()
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed * torch.nn.functional.silu(gate.float())).to(x.dtype)
