"""The token embedding table in pinned host memory, its rows gathered by a kernel on the device.

Shape legend: V vocabulary, H hidden, N tokens.

Why: a step reads only its tokens' rows of the table (N x H), yet on the device the whole table
takes V x H of the memory the expert cache and the KV pool share (0.6 GB for Qwen3-30B-A3B in
bf16, 1 GB for Qwen3.6, 1.2 GB for gpt-oss: hundreds of expert slots). Under unified addressing
a pinned host address is a device address, so the kernel loads the rows over the bus where the
step needs them, inside a captured decode graph too (a decode step reads a few KB; an 8k-token
prefill chunk 33 MB at Qwen3's width, about a millisecond). llama.cpp keeps this table in host
memory as well.

Twin: `gather_rows_twin` (torch's embedding on the host). Bit-exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from freetoken.kernels.triton import pdl

BLOCK = 1024


@triton.jit
def _gather_rows_kernel(table_ptr, ids_ptr, out_ptr, H, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    token = tl.load(ids_ptr + row).to(tl.int64)
    tl.store(out_ptr + row.to(tl.int64) * H + offs, tl.load(table_ptr + token * H + offs, mask=mask), mask=mask)


def gather_rows(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """table[ids] on ids' device: ids [...] (integers in [0, V): the caller checks them; out of range
    the kernel reads outside the table) -> [..., H]. The table lies in pinned host memory (or on
    the device, or anywhere under Triton's interpreter)."""
    if table.dim() != 2 or not table.is_contiguous():
        raise ValueError(f"gather_rows: the table must be a contiguous [V, H] matrix, got {tuple(table.shape)}")
    if table.device.type == "cpu" and ids.is_cuda and not table.is_pinned():
        raise ValueError("gather_rows: a host table must be pinned (the device reads it in place)")
    H = table.shape[1]
    flat = ids.reshape(-1)
    out = torch.empty(flat.numel(), H, dtype=table.dtype, device=ids.device)
    if flat.numel():
        _gather_rows_kernel[(flat.numel(), triton.cdiv(H, BLOCK))](table, flat, out, H, BLOCK=BLOCK,
                                                                   **pdl.launch(out))
    return out.view(*ids.shape, H)


def gather_rows_twin(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The specification: torch's embedding on the table's device, moved to ids' device."""
    return F.embedding(ids.to(table.device), table).to(ids.device)
