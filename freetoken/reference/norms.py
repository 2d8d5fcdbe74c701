"""Reference semantics of RMSNorm, alone and after the residual add (twins of
kernels/triton/rms_norm.py and of the norms inside kernels/triton/{norm_linear,decode_attention}.py).

Rounding points follow the Hugging Face implementations: x widened to fp32, x * rsqrt(mean(x^2)
+ eps) rounded to the activation dtype, then times the weight in that dtype.
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


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of a weight stored zero-centred (qwen3_next, qwen3_5): x * rsqrt(mean(x^2) + eps)
    times (1 + weight), all in fp32, rounded once to x's dtype, as transformers computes it."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


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
