"""Contiguous per-sequence KV cache.

Shape legend: L layers, R sequence rows (concurrent sequences), S max sequence length,
Hkv key/value heads, D head dim, B rows in a step, T new tokens per row.

Each running sequence owns one row for its lifetime; rows are handed out and returned by
the scheduler. Rows are given as host ints: a single row is a plain slice (a view, no gather,
no device read); several rows index through a device tensor made once per row set.
(Paged KV with prefix reuse replaces this for agent sessions.)
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
        self._row_tensors: dict[tuple[int, ...], torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def resized(self, max_len: int) -> KVCache:
        """A cache of `max_len` positions per row holding this one's first positions."""
        L, R, _, hkv, D = self.k.shape
        new = KVCache(L, R, max_len, hkv, D, self.k.dtype, str(self.k.device))
        keep = min(max_len, self.max_len)
        new.k[:, :, :keep] = self.k[:, :, :keep]
        new.v[:, :, :keep] = self.v[:, :, :keep]
        return new

    def _rows(self, rows: list[int]) -> torch.Tensor:
        key = tuple(rows)
        if key not in self._row_tensors:
            if len(self._row_tensors) > 256:
                self._row_tensors.clear()
            self._row_tensors[key] = torch.tensor(rows, device=self.k.device)
        return self._row_tensors[key]

    def write(self, layer: int, rows: list[int], positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """rows: B host ints, positions [B, T], k/v [B, T, Hkv, D]."""
        if len(rows) == 1:
            self.k[layer, rows[0]].index_copy_(0, positions[0], k[0])
            self.v[layer, rows[0]].index_copy_(0, positions[0], v[0])
            return
        r = self._rows(rows)[:, None].expand_as(positions)  # [B, T]
        self.k[layer, r, positions] = k
        self.v[layer, r, positions] = v

    def read(self, layer: int, rows: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` positions of each row: k/v [B, length, Hkv, D]."""
        if len(rows) == 1:
            row = rows[0]
            return self.k[layer, row : row + 1, :length], self.v[layer, row : row + 1, :length]
        r = self._rows(rows)
        return self.k[layer, r, :length], self.v[layer, r, :length]
