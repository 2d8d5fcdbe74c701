"""A small buffer moved between pinned host memory and the device by a kernel, not by the copy
engine: a captured decode step's inputs, loaded by the step's first kernel (`read_host`), and
the device counters and stamps the host reads after each step, stored by the step's last kernel
(`write_host`).

Shape legend: N elements (any dtype; source and destination alike, both contiguous).

Why a kernel and not a copy: the host writes a step's inputs (tokens, positions, KV indices)
into one pinned buffer with numpy, and the graph starts with this kernel, which reads that
buffer over the bus (under unified addressing a pinned host address is a device address).
Before it, the host made the inputs with torch and copied them from pageable memory before each
replay: host work every step while the device idled (docs/lab, "A captured step reads its
inputs from pinned memory"). A copy-engine
transfer captured in the graph would take no host time either, but could queue behind hybrid's
background fills on the copy engine; this kernel's loads do not use the copy engine.

Why a kernel for the way back: a device-to-host copy goes through a copy engine, and the copy
engines are shared with every other process on the GPU. Beside another process's large
host-to-device copies, a step that adds small synchronous reads (`.tolist()`) to the sampler's
one may wait for the engine each time (the contention runs, docs/lab). The kernel's stores reach
pinned memory over the bus without a copy engine and, captured in the step's graph, without a
launch from the host; the host reads them once the step has ended.

The loads are volatile: the host rewrites the buffer before every replay, and no cached line of
an earlier step may stand in for it.
Twin: `read_host_twin` (a copy), for both directions. Bit-exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton import pdl

BLOCK = 1024


@triton.jit
def _host_copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask, volatile=True), mask=mask)


def _check(src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"a kernel's host copy: source {tuple(src.shape)} {src.dtype} and destination "
                         f"{tuple(dst.shape)} {dst.dtype} must match")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("a kernel's host copy: source and destination must be contiguous")


def read_host(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[:] = src, read by a kernel on dst's device; src in pinned host memory (or on the
    device, or anywhere under Triton's interpreter)."""
    _move(src, dst, host=src, device=dst, launch=pdl.launch(dst))


def write_host(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[:] = src, stored by a kernel on src's device into dst in pinned host memory (or on
    the device, or anywhere under Triton's interpreter). Queued on the current stream: the host
    may read dst once work queued after this call has completed."""
    # (no PDL: it ends a step and must see every earlier kernel's stores)
    _move(src, dst, host=dst, device=src, launch={"PDL": False})


def _move(src: torch.Tensor, dst: torch.Tensor, host: torch.Tensor, device: torch.Tensor, launch: dict) -> None:
    _check(src, dst)
    n = src.numel()
    if not n:
        return
    if host.device.type == "cpu" and device.device.type == "cuda" and not host.is_pinned():
        raise ValueError("the host side of a kernel's copy must be pinned (the device reads or writes it in place)")
    _host_copy_kernel[(triton.cdiv(n, BLOCK),)](src, dst, n, BLOCK=BLOCK, **launch)


def read_host_twin(src: torch.Tensor, dst: torch.Tensor) -> None:
    """The specification: a copy."""
    _check(src, dst)
    dst.copy_(src)


def load_into(src: torch.Tensor, dst: torch.Tensor) -> None:
    """What a step's staged buffers use: the kernel where dst is on CUDA, the twin on the CPU
    (the engine's CPU path runs the twins)."""
    (read_host if dst.is_cuda else read_host_twin)(src, dst)
