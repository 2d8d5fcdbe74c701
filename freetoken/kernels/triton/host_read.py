"""A buffer in pinned host memory read by a kernel into device memory: a captured decode step's
inputs, loaded by the step's first kernel.

Shape legend: N elements (any dtype; source and destination alike, both contiguous).

Why a kernel and not a copy: the host writes a step's inputs (tokens, positions, KV indices)
into one pinned buffer with numpy, and the graph starts with this kernel, which reads that
buffer over the bus (under unified addressing a pinned host address is a device address).
Before it, the host made the inputs with torch and copied them from pageable memory before each
replay: host work every step while the device idled (docs/lab, "A captured step reads its
inputs from pinned memory"). A copy-engine
transfer captured in the graph would take no host time either, but could queue behind hybrid's
background fills on the copy engine; this kernel's loads do not use the copy engine.

The loads are volatile: the host rewrites the buffer before every replay, and no cached line of
an earlier step may stand in for it.
Twin: `read_host_twin` (a copy). Bit-exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton import pdl

BLOCK = 1024


@triton.jit
def _read_host_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask, volatile=True), mask=mask)


def _check(src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"read_host: source {tuple(src.shape)} {src.dtype} and destination "
                         f"{tuple(dst.shape)} {dst.dtype} must match")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("read_host: source and destination must be contiguous")


def read_host(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[:] = src, read by a kernel on dst's device; src in pinned host memory (or on the
    device, or anywhere under Triton's interpreter)."""
    _check(src, dst)
    n = src.numel()
    if not n:
        return
    if src.device.type == "cpu" and dst.device.type == "cuda" and not src.is_pinned():
        raise ValueError("read_host: a host source must be pinned (the device reads it in place)")
    _read_host_kernel[(triton.cdiv(n, BLOCK),)](src, dst, n, BLOCK=BLOCK, **pdl.launch(dst))


def read_host_twin(src: torch.Tensor, dst: torch.Tensor) -> None:
    """The specification: a copy."""
    _check(src, dst)
    dst.copy_(src)


def load_into(src: torch.Tensor, dst: torch.Tensor) -> None:
    """What a step's staged buffers use: the kernel where dst is on CUDA, the twin on the CPU
    (the engine's CPU path runs the twins)."""
    (read_host if dst.is_cuda else read_host_twin)(src, dst)
