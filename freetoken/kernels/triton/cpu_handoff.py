"""The device side of a captured layer's CPU branch, as two kernels instead of ~11 launches.

Shape legend: N tokens, K top-k, H hidden; the mailbox buffers (kernels/cpu/doorbell.py) are
pinned host memory, read and written in place through unified addressing.

  post_cpu_work: mailbox.x[:N] = x (fp32), mailbox.weights[:N] = weights (fp32),
                 mailbox.fids[:N] = ids + base where routes < 0, else -1;
  add_cpu_result: y + mailbox.out[:N], the CPU's fp32 sum rounded to y's dtype first, then the
                 sum rounded again (the eager path's two roundings).
Twins: the torch expressions in `post_cpu_work_torch` / `add_cpu_result_torch`, equal bit for
bit. The host buffer is read with volatile loads: the CPU wrote it after the last kernel ran.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton.moe_gemm import rne_bf16


@triton.jit
def _post_kernel(x_ptr, w_ptr, ids_ptr, routes_ptr, mx_ptr, mw_ptr, mf_ptr, H, K, base,
                 BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        m = h0 + h < H
        tl.store(mx_ptr + n * H + h0 + h, tl.load(x_ptr + n * H + h0 + h, mask=m).to(tl.float32), mask=m)
    k = tl.arange(0, BLOCK_K)
    mk = k < K
    tl.store(mw_ptr + n * K + k, tl.load(w_ptr + n * K + k, mask=mk).to(tl.float32), mask=mk)
    ids = tl.load(ids_ptr + n * K + k, mask=mk, other=0).to(tl.int32)
    routes = tl.load(routes_ptr + n * K + k, mask=mk, other=0)
    tl.store(mf_ptr + n * K + k, tl.where(routes < 0, ids + base, -1), mask=mk)


@triton.jit
def _add_kernel(y_ptr, out_ptr, res_ptr, H, BLOCK_H: tl.constexpr, BF16: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        m = h0 + h < H
        cpu = tl.load(out_ptr + n * H + h0 + h, mask=m, other=0.0, volatile=True)
        y = tl.load(y_ptr + n * H + h0 + h, mask=m, other=0.0).to(tl.float32)
        if BF16:
            tl.store(res_ptr + n * H + h0 + h, rne_bf16(y + rne_bf16(cpu).to(tl.float32)), mask=m)
        else:
            tl.store(res_ptr + n * H + h0 + h, (y + cpu).to(res_ptr.dtype.element_ty), mask=m)


def post_cpu_work(x, weights, ids, routes, base: int, mx, mw, mf) -> None:
    """x [N, H], weights/ids/routes [N, K] on the device; mx [R, H] fp32, mw [R, K] fp32,
    mf [R, K] int32 (R >= N; pinned host, or device tensors for tests)."""
    n, h = x.shape
    k = ids.shape[1]
    _post_kernel[(n,)](x.contiguous(), weights.contiguous(), ids.contiguous(), routes.contiguous(), mx, mw, mf,
                       h, k, base, BLOCK_H=min(1024, triton.next_power_of_2(h)),
                       BLOCK_K=triton.next_power_of_2(k), num_warps=4)


def add_cpu_result(y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """y [N, H] (bf16 or fp32) + out[:N] (fp32, pinned host) -> [N, H] in y's dtype."""
    n, h = y.shape
    res = torch.empty_like(y)
    _add_kernel[(n,)](y.contiguous(), out, res, h, BLOCK_H=min(1024, triton.next_power_of_2(h)),
                      BF16=y.dtype == torch.bfloat16, num_warps=4)
    return res


def post_cpu_work_torch(x, weights, ids, routes, base: int, mx, mw, mf) -> None:
    n = x.shape[0]
    mx[:n].copy_(x.float(), non_blocking=True)
    mw[:n].copy_(weights.float(), non_blocking=True)
    mf[:n].copy_(torch.where(routes < 0, ids.to(torch.int32) + base, -1), non_blocking=True)


def add_cpu_result_torch(y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return y + out[: y.shape[0]].to(device=y.device, non_blocking=True).to(y.dtype)
