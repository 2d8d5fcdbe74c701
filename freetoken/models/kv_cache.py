"""Contiguous per-sequence KV cache.

Shape legend: L layers, R sequence rows (concurrent sequences), S max sequence length,
Hkv key/value heads, D head dim.

Each running sequence owns one row for its lifetime; rows are handed out and returned by
the scheduler. (Paged KV with prefix reuse replaces this for agent sessions.)
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self, num_layers: int, rows: int, max_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str
    ) -> None:
        shape = (num_layers, rows, max_len, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, R, S, Hkv, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, R, S, Hkv, D]
        self.max_len = max_len
        self.rows = rows

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """rows [B], positions [B, T], k/v [B, T, Hkv, D]."""
        r = rows[:, None].expand_as(positions)  # [B, T]
        self.k[layer, r, positions] = k
        self.v[layer, r, positions] = v

    def read(self, layer: int, rows: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` positions of each row: k/v [B, length, Hkv, D]."""
        return self.k[layer, rows, :length], self.v[layer, rows, :length]
