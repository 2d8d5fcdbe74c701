"""Reference semantics of the rotary position embedding (twin of kernels/triton/rotary.py and of
the rotary inside kernels/triton/decode_attention.py).

Shape legend: B sequences, T tokens per sequence, D head dim (even).
"""

from __future__ import annotations

import torch


class Rotary:
    """RoPE tables computed in fp32 and applied in the activation dtype, as the references do."""

    def __init__(self, head_dim: int, theta: float, device: str) -> None:
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, heads, D], cos/sin [B, T, D]."""
        cos, sin = cos[:, :, None], sin[:, :, None]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
