"""Reference semantics of the rotary position embedding (twin of kernels/triton/rotary.py and of
the rotary inside kernels/triton/decode_attention.py).

Shape legend: B sequences, T tokens per sequence, D head dim (even).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from freetoken.loader.rope_scaling import YarnRope


def yarn_inv_freq(head_dim: int, theta: float, yarn: YarnRope) -> torch.Tensor:
    """YaRN's frequencies [D/2]: each dimension's default frequency where it turns more than
    `beta_fast` times over the original context, divided by `factor` where it turns fewer than
    `beta_slow` times, and a linear blend across the dimensions between."""
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)

    def dimension(rotations: float) -> float:  # the dimension turning `rotations` times over the context
        wavelengths = yarn.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(wavelengths) / (2 * math.log(theta))

    low, high = dimension(yarn.beta_fast), dimension(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: the default frequency, 0: the interpolated one
    return (1.0 / (yarn.factor * base)) * (1 - kept) + (1.0 / base) * kept


class Rotary:
    """RoPE tables computed in fp32 and applied in the activation dtype, as the references do.
    yarn: YaRN scaling (its frequencies, and cos/sin scaled by its attention factor)."""

    def __init__(self, head_dim: int, theta: float, device: str, yarn: YarnRope | None = None) -> None:
        if yarn is None:
            self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
                                             / head_dim))
            self.scale = 1.0
        else:
            self.inv_freq = yarn_inv_freq(head_dim, theta, yarn).to(device)
            self.scale = yarn.attention_factor

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        if self.scale == 1.0:
            return emb.cos().to(dtype), emb.sin().to(dtype)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, heads, D], cos/sin [B, T, D]."""
        cos, sin = cos[:, :, None], sin[:, :, None]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
