"""Paged KV cache.

Shape legend: L layers, P pages, Z page size (token positions per page), Hkv key/value heads,
D head dim, B sequences in a step, T new tokens per sequence, Lk attended key length.

The pool is P pages of Z positions; a sequence's page table lists its pages in order, so its
position p lives at page_table[p // Z], offset p % Z. Which pages a sequence holds (and which
it shares with others through the prefix cache) is the Scheduler's business
(cache/prefix_cache.py); here a step only needs, per layer, where to write its new keys and
where to read its keys from. Both index sets are built once per forward (`KVView`), on the
host, and cross to the device in one copy (a captured decode step writes them into its pinned
input buffer instead, which the step reads itself: engine/step_inputs.py).

The pool resizes in place (cache/resizable_rows.py): each layer's positions are rows whose
memory is committed only up to the pool's size, so a live resize moves the pages it keeps from
past the new end into pages nobody keeps and gives the tail back, or commits only the new
pages, without a second pool beside the first.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from freetoken.cache.resizable_rows import ResizableRows, resize_together


def device_memory_bytes(device: str) -> int:
    """The memory a pool on `device` could ever take: the device's whole memory, or the host's."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class KVCache:
    def __init__(
        self, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: str,
    ) -> None:
        row_bytes = kv_heads * head_dim * dtype.itemsize
        # no pool can outgrow the memory there is: K and V of every layer share it
        self.max_pages = max(num_pages, device_memory_bytes(device) // (2 * num_layers * page_size * row_bytes))
        self.banks = [ResizableRows(num_layers, self.max_pages * page_size, (kv_heads, head_dim), dtype, device,
                                    num_pages * page_size) for _ in "kv"]
        self.k, self.v = (bank.tensor for bank in self.banks)  # [L, P*Z, Hkv, D] each (every layer contiguous)
        self.num_pages = num_pages
        self.page_size = page_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def tokens(self) -> int:
        return self.num_pages * self.page_size

    def view(
        self, page_tables: list[list[int]], positions: list[list[int]], key_len: int, padded: bool = False
    ) -> KVView:
        """The step's KV access: sequence b writes its new tokens at positions[b] and reads
        positions 0..key_len-1 (keys past a sequence's own length are masked by attention).
        padded: key_len is a fixed bucket above every sequence's length (decode graphs keep
        shapes fixed that way), so attention must always mask."""
        index, n = step_index(page_tables, positions, key_len, self.page_size)
        index = torch.from_numpy(index).to(self.k.device)
        return KVView(self, index[:n], index[n:].view(len(page_tables), key_len), padded)

    def committed_bytes(self, num_pages: int) -> int:
        """The memory the pool takes at `num_pages` pages."""
        return sum(bank.committed_bytes(num_pages * self.page_size) for bank in self.banks)

    def resize(self, num_pages: int, mapping: dict[int, int]) -> None:
        """Resize in place to `num_pages`; the pages in `mapping` keep their contents at page
        `mapping[old]`. Pages move only into pages that no other kept page occupies (the
        Scheduler moves only pages past a shrunk pool's end, into pages nobody keeps), so the
        moves need no second pool. Growing commits the new pages first: a refusal raises
        torch.OutOfMemoryError and changes nothing."""
        if not 1 <= num_pages <= self.max_pages:
            raise ValueError(f"the KV pool takes 1 to {self.max_pages} pages here, not {num_pages}")
        moves = [(old, new) for old, new in mapping.items() if old != new]
        targets = [new for _, new in moves]
        if any(not 0 <= new < num_pages for new in mapping.values()) or set(targets) & set(mapping):
            raise ValueError("a KV page may move only into a page below the new size that no kept page occupies")
        tokens = num_pages * self.page_size
        if num_pages > self.num_pages:
            self._resize_banks(tokens)
        if moves:
            z = self.page_size
            src = torch.tensor([p * z + i for p, _ in moves for i in range(z)], device=self.k.device)
            dst = torch.tensor([q * z + i for q in targets for i in range(z)], device=self.k.device)
            for layer in range(self.k.shape[0]):  # layer by layer: the temporary is one layer's moved pages
                for pool in (self.k, self.v):
                    pool[layer, dst] = pool[layer, src]
        if num_pages < self.num_pages:
            self._resize_banks(tokens)
        self.num_pages = num_pages

    def _resize_banks(self, tokens: int) -> None:
        resize_together(self.banks, tokens)
        self.k, self.v = (bank.tensor for bank in self.banks)


def step_index(page_tables: list[list[int]], positions: list[list[int]], key_len: int,
               page_size: int) -> tuple[np.ndarray, int]:
    """A step's flat pool positions, int64: every sequence's new tokens (n of them, in order),
    then [B, key_len] the keys each sequence reads. In numpy, since it runs on the host before
    every step, while the device waits, and torch's fixed cost per op on CPU tensors would
    outweigh the work of the index's many small ops."""
    n = sum(len(pos) for pos in positions)
    index = np.empty(n + len(page_tables) * key_len, np.int64)
    fill_step_index(page_tables, positions, key_len, page_size, index[:n],
                    index[n:].reshape(len(page_tables), key_len))
    return index, n


def fill_step_index(page_tables: list[list[int]], positions: list[list[int]], key_len: int, page_size: int,
                    write: np.ndarray, read: np.ndarray) -> None:
    """`step_index` into given arrays: write [n] (int64) the new tokens' pool positions, read
    [B, key_len] (int64) the keys each sequence reads (a captured decode step's pinned inputs)."""
    z = page_size
    writes = [np.asarray(pos, np.int64) for pos in positions]
    n = sum(len(w) for w in writes)
    if write.shape != (n,) or read.shape != (len(page_tables), key_len):
        raise ValueError(f"step index arrays {write.shape} and {read.shape} do not fit {n} new tokens and "
                         f"{len(page_tables)} sequences of {key_len} keys")
    offsets = np.arange(z, dtype=np.int64)
    start = 0
    for b, (table, pos) in enumerate(zip(page_tables, writes, strict=True)):
        pages = np.asarray(table, np.int64)
        if len(pos) and (pos.min() < 0 or pos.max() >= len(pages) * z):
            raise IndexError(f"sequence {b}: a new token's position is outside its {len(table)} pages")
        write[start:start + len(pos)] = pages[pos // z] * z + pos % z
        start += len(pos)
        held = min(key_len, len(pages) * z)
        if not held:
            raise IndexError(f"sequence {b} holds no page to read keys from")
        # the positions the first pages hold, in order (only the pages the keys reach)
        read[b, :held] = np.add.outer(pages[:-(-held // z)] * z, offsets).ravel()[:held]
        # Positions past a sequence's pages (shorter sequences in a batch) read its first
        # position instead; the attention mask hides them.
        read[b, held:] = pages[0] * z


class KVView:
    """One forward step's reads and writes into the pool."""

    def __init__(
        self, cache: KVCache, write_index: torch.Tensor, read_index: torch.Tensor, padded: bool = False
    ) -> None:
        self.cache = cache
        self.padded = padded
        self.write_index = write_index  # [B*T] flat pool positions of the new tokens
        self.read_index = read_index  # [B, Lk] flat pool positions of each sequence's keys
        # linear-attention models: the recurrent-state pool and each row's slot in it (attach_states)
        self.states = None  # models/recurrent_state.py's RecurrentStatePool
        self.state_slots: torch.Tensor | None = None  # [B] int64; -(s + 1): a read-only row
        # the row whose linear-attention output each row takes (None: its own): a captured
        # step's padding rows take row 0's (engine/step_inputs.py)
        self.state_rows: torch.Tensor | None = None  # [B] int64

    def attach_states(self, states, slots: list[int]) -> KVView:
        """The step's rows read and update these slots of `states` (one per sequence, in order)."""
        return self.attach_state_slots(states, torch.tensor(slots, dtype=torch.int64, device=self.write_index.device))

    def attach_state_slots(self, states, slots: torch.Tensor, rows: torch.Tensor | None = None) -> KVView:
        """As attach_states, with the slots (and the rows each takes its output from) already on the device."""
        self.states, self.state_slots, self.state_rows = states, slots, rows
        return self

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [B, T, Hkv, D]."""
        self.cache.k[layer].index_copy_(0, self.write_index, k.reshape(-1, *k.shape[2:]))
        self.cache.v[layer].index_copy_(0, self.write_index, v.reshape(-1, *v.shape[2:]))

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k/v [B, Lk, Hkv, D]."""
        return self.cache.k[layer][self.read_index], self.cache.v[layer][self.read_index]
