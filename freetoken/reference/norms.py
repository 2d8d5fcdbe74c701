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
