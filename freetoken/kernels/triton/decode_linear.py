"""A decode step's small linear layers: out = x @ w.T (+ bias) for a handful of rows, one launch.

Shape legend: M rows (one token per sequence, 1..MAX_ROWS), K in features, N out features.
Twin: `linear_twin` (fp32 products and sums of the widened inputs, the bias added, one rounding
to x's dtype); equal within the tolerance registered in kernels/specs/dense.py, since the
summation order differs. Deterministic: the same inputs give the same bits on one device.

Why: a router's weight is small (a few hundred KB), so its time is latency, and inside a
captured step cuBLAS's launch and set-up take longer than one program per weight row (two at
four rows), each reading its row whole (benchmarks/decode_linear_probe.py and its results).
Timed alone, the attention's larger projections ran no faster than cuBLAS at one row and
slower at four. In a step they do not run alone: with programmatic dependent launch a
program is placed while the kernels before it still run (kernels/triton/pdl.py), and when a
weight tile fits one block (K <= BLOCK_K) the program loads it before it waits for them, so the
projection's weights stream in while the norm or the attention before it runs, and after the
wait only x is read. `projection` takes that path at one row; more rows keep cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from freetoken.kernels.triton import pdl
from freetoken.kernels.triton.rounding import store_rounded

MAX_ROWS = 4
# (BLOCK_N, BLOCK_K, num_warps) per row count rounded up to a power of two: the fastest of
# benchmarks/decode_linear_probe.py's choices at 1 and 4 rows (2 rows take 1 row's).
# At one row `blocks_for` widens BLOCK_K to the whole row (up to ONE_ROW_MAX_K) and groups rows
# while the programs still cover the SMs twice.
BLOCKS = {1: (1, 2048, 4), 2: (1, 2048, 4), 4: (2, 2048, 8)}
ONE_ROW_MAX_K = 4096
TILE_ELEMENTS = 8192  # a one-row program's weight tile: 16 KB of bf16, 32 registers a thread at 4 warps
MIN_PROGRAMS = 264  # two per SM of the H200's 132


def blocks_for(rows: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [rows, k] x [n, k] product: the measured table, and at
    one row the whole weight row in one block (so that it can be loaded before the PDL wait) with
    as many rows a program as keep TILE_ELEMENTS and MIN_PROGRAMS."""
    p = triton.next_power_of_2(max(rows, 1))
    block_n, block_k, warps = BLOCKS[p]
    if p == 1 and triton.next_power_of_2(k) <= ONE_ROW_MAX_K:
        block_k = triton.next_power_of_2(k)
        block_n = max(1, TILE_ELEMENTS // block_k)
        while block_n > 1 and triton.cdiv(n, block_n) < MIN_PROGRAMS:
            block_n //= 2
    return block_n, block_k, warps


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, PREFETCH: tl.constexpr,
                   PDL: tl.constexpr):
    pdl.signal(PDL)
    n_offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offs < N
    rows = tl.arange(0, ROWS)  # ROWS: M rounded up to a power of two
    r_mask = rows < M
    w_rows = w_ptr + n_offs.to(tl.int64)[:, None] * K  # [BLOCK_N, 1]
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    if PREFETCH:  # K <= BLOCK_K: the weight tile (written by no kernel of the chain) before the wait
        k_offs = tl.arange(0, BLOCK_K)
        k_mask = k_offs < K
        w = tl.load(w_rows + k_offs[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        pdl.wait(PDL)
        x = tl.load(x_ptr + rows[:, None] * K + k_offs[None, :], mask=r_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)  # [ROWS, BLOCK_K]
        acc += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    else:
        pdl.wait(PDL)
        for k0 in range(0, K, BLOCK_K):
            k_offs = k0 + tl.arange(0, BLOCK_K)
            k_mask = k_offs < K
            w = tl.load(w_rows + k_offs[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            x = tl.load(x_ptr + rows[:, None] * K + k_offs[None, :], mask=r_mask[:, None] & k_mask[None, :],
                        other=0.0).to(tl.float32)  # [ROWS, BLOCK_K]
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n_offs, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    store_rounded(out_ptr + rows[:, None] * N + n_offs[None, :], acc, r_mask[:, None] & n_mask[None, :], OUT_BF16)


def decode_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] with at most MAX_ROWS rows in all, w [N, K], bias [N] or None -> [..., N] in
    x's dtype. blocks: (BLOCK_N, BLOCK_K, num_warps), powers of two (None: `blocks_for`)."""
    n, k = w.shape
    rows = x.numel() // max(1, x.shape[-1])
    if x.shape[-1] != k or rows > MAX_ROWS or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"decode_linear: x {tuple(x.shape)} (at most {MAX_ROWS} rows), w {tuple(w.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)} do not fit")
    if not w.is_contiguous():
        raise ValueError("decode_linear: the weight must be contiguous")
    if x.dtype != w.dtype or (bias is not None and bias.dtype != w.dtype):
        raise ValueError(f"decode_linear: x {x.dtype}, w {w.dtype} and bias must share a dtype")
    x2 = x.reshape(rows, k).contiguous()
    bias = bias.contiguous() if bias is not None else None
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = blocks or blocks_for(rows, n, k)
    block_k = min(block_k, triton.next_power_of_2(k))
    _linear_kernel[(triton.cdiv(n, block_n),)](x2, w, bias if bias is not None else w, out, rows, n, k,
                                                ROWS=triton.next_power_of_2(max(rows, 1)), BLOCK_N=block_n,
                                                BLOCK_K=block_k, HAS_BIAS=bias is not None,
                                                OUT_BF16=x.dtype == torch.bfloat16,
                                                PREFETCH=k <= block_k, num_warps=warps,
                                                **pdl.launch(out))
    return out.view(*x.shape[:-1], n)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The router's linear op on CUDA: `decode_linear` for a decode step's few rows, cuBLAS
    (F.linear) for prompts, whose many rows make it a real GEMM (and for a weight that is a
    strided view, which the kernel does not read)."""
    if x.numel() <= MAX_ROWS * x.shape[-1] and w.is_contiguous():
        return decode_linear(x, w, bias)
    return F.linear(x, w, bias)


PROJECTION_ROWS = 1  # up to how many rows `projection` runs the attention's projections here


def projection(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The attention's q/k/v and output projections in a fused decode step on CUDA:
    `decode_linear` at one row (its weights loaded before the PDL wait), cuBLAS at more rows,
    where the probe measured it up to 2.7x faster."""
    if x.numel() <= PROJECTION_ROWS * x.shape[-1] and w.is_contiguous():
        return decode_linear(x, w, bias)
    return F.linear(x, w, bias)


def linear_twin(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The specification: fp32 products and sums, the bias added, one rounding to x's dtype."""
    out = x.float() @ w.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
