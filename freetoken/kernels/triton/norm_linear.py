"""A decode step's RMSNorm inside the linear layer that reads it: one launch where two ran.

Shape legend: M rows (one token per sequence, 1..MAX_ROWS), H hidden (in features, the whole row
one block), N out features.
Twin: `norm_linear_twin` (add_rms_norm, or rms_norm at the first layer, then `linear_twin`):
kernels/specs/linear.py checks the residual sum bit for bit, the normed row within the RMSNorm
pair's bound, and the products against `linear_twin` applied to the kernel's own normed row
(the decode_linear pair's bound).

Why: in a captured one-token step the RMSNorm before the attention's q/k/v projection, and the
residual add and norm before the router, each ran as a one-program kernel the projection then
waited for. Here every program of the projection loads its weight tile before the PDL wait (as
decode_linear does), then reads the residual stream's rows (a few KB, from L2), adds, normalises
and multiplies: the norm's work repeated in every program instead of a kernel boundary. Program 0
stores the sum and, where a later kernel reads it (the MoE experts do; the attention does not),
the normed row. Each fusion saves the step a launch and a round trip of the row through memory
(BENCHMARKS.md, norm fusion); running the routing in the router's launch as well did not pay
(its last program to finish, found by an atomic counter, ran slower than the routing kernel
it replaced), so the routing keeps its own kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton import pdl
from freetoken.kernels.triton.decode_linear import (
    MAX_ROWS,
    ONE_ROW_MAX_K,
    blocks_for,
    linear,
    linear_twin,
    projection,
)
from freetoken.kernels.triton.rms_norm import fused_add_rms_norm, fused_rms_norm
from freetoken.kernels.triton.rounding import rne_bf16, store_rounded
from freetoken.reference.norms import add_rms_norm, rms_norm

PROJECTION_ROWS = 1  # as decode_linear's: more rows take cuBLAS for the projection, so no fusion


@triton.jit
def _norm_linear_kernel(
    x_ptr, res_ptr, sum_ptr, normed_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, M, N, H, eps,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, ADD: tl.constexpr, STORE_NORMED: tl.constexpr,
    HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, PDL: tl.constexpr,
):
    pdl.signal(PDL)
    pid = tl.program_id(0)
    n_offs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offs < N
    rows = tl.arange(0, ROWS)  # ROWS: M rounded up to a power of two
    r_mask = rows < M
    h_offs = tl.arange(0, BLOCK_H)
    h_mask = h_offs < H
    # the dense weights (written by no kernel of the chain) before the wait
    w = tl.load(w_ptr + n_offs.to(tl.int64)[:, None] * H + h_offs[None, :], mask=n_mask[:, None] & h_mask[None, :],
                other=0.0)
    nw = tl.load(nw_ptr + h_offs, mask=h_mask, other=0.0).to(tl.float32)
    pdl.wait(PDL)
    xm = r_mask[:, None] & h_mask[None, :]
    xo = rows[:, None] * H + h_offs[None, :]
    x = tl.load(x_ptr + xo, mask=xm, other=0.0).to(tl.float32)  # [ROWS, BLOCK_H]
    if ADD:  # the residual sum first, rounded to the activation dtype as a tensor add rounds it
        x += tl.load(res_ptr + xo, mask=xm, other=0.0).to(tl.float32)
        if OUT_BF16:
            x = rne_bf16(x).to(tl.float32)
        else:
            x = x.to(sum_ptr.dtype.element_ty).to(tl.float32)
    var = tl.sum(x * x, axis=1) / H  # [ROWS]
    y = x * (1.0 / tl.sqrt_rn(var + eps))[:, None]
    if OUT_BF16:  # the twin's rounding points: the normalised row, then times the weight
        normed = rne_bf16(nw[None, :] * rne_bf16(y).to(tl.float32)).to(tl.float32)
    else:
        normed = nw[None, :] * y
    if pid == 0:
        if ADD:
            store_rounded(sum_ptr + xo, x, xm, OUT_BF16)
        if STORE_NORMED:
            store_rounded(normed_ptr + xo, normed, xm, OUT_BF16)
    acc = tl.sum(normed[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)  # [ROWS, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n_offs, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    store_rounded(out_ptr + rows[:, None] * N + n_offs[None, :], acc, r_mask[:, None] & n_mask[None, :], OUT_BF16)


def _launch(h, delta, norm_w, eps, w, bias, store_normed: bool):
    """The kernel over h [M, H] (+ delta) -> (sum, normed or None, out [M, N])."""
    m, hidden = h.shape
    n = w.shape[0]
    block_h = triton.next_power_of_2(hidden)
    if m > MAX_ROWS or block_h > ONE_ROW_MAX_K:
        raise ValueError(f"norm_linear: {m} rows of {hidden} (at most {MAX_ROWS} rows of {ONE_ROW_MAX_K})")
    if w.shape[1] != hidden or norm_w.shape != (hidden,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"norm_linear: h {tuple(h.shape)}, norm weight {tuple(norm_w.shape)}, w {tuple(w.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)} do not fit")
    if h.dtype not in (torch.bfloat16, torch.float32) or any(
            t is not None and t.dtype != h.dtype for t in (delta, norm_w, w, bias)):
        raise ValueError("norm_linear: h, delta and the weights must share one dtype, bfloat16 or float32")
    if delta is not None and delta.shape != h.shape:
        raise ValueError(f"norm_linear: delta {tuple(delta.shape)} != h {tuple(h.shape)}")
    if not w.is_contiguous():
        raise ValueError("norm_linear: the weight must be contiguous")
    add = delta is not None
    h = h.contiguous()
    delta = delta.contiguous() if add else h  # (not read without the add)
    total = torch.empty_like(h) if add else h
    normed = torch.empty_like(h) if store_normed else h
    out = torch.empty((m, n), dtype=h.dtype, device=h.device)
    block_n, _, warps = blocks_for(m, n, hidden)
    _norm_linear_kernel[(triton.cdiv(n, block_n),)](
        h, delta, total, normed, norm_w.contiguous(), w, bias if bias is not None else w, out, m, n, hidden, eps,
        ROWS=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_H=block_h, ADD=add,
        STORE_NORMED=store_normed, HAS_BIAS=bias is not None, OUT_BF16=h.dtype == torch.bfloat16, num_warps=warps,
        **pdl.launch(out),
    )
    return total, normed if store_normed else None, out


def _fits(h: torch.Tensor, w: torch.Tensor, rows: int) -> bool:
    return h.shape[0] <= rows and w.is_contiguous() and triton.next_power_of_2(h.shape[-1]) <= ONE_ROW_MAX_K


def norm_project(h: torch.Tensor, delta: torch.Tensor | None, norm_w: torch.Tensor, eps: float, w: torch.Tensor,
                 bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention's input in a fused one-token step: h [B, 1, H] (+ delta, what the layer
    before added; None at the first layer) -> (the residual stream h + delta, the q/k/v
    projection of its norm [B, N]). One launch at up to PROJECTION_ROWS rows;
    else the norm kernel, then the projection as `decode_linear.projection` runs it."""
    b = h.shape[0]
    h2 = h.reshape(b, -1)
    if _fits(h2, w, PROJECTION_ROWS):
        total, _, out = _launch(h2, delta.reshape(b, -1) if delta is not None else None, norm_w, eps, w, bias, False)
        return total.view(h.shape), out
    if delta is None:
        total, normed = h, fused_rms_norm(h, norm_w, eps)
    else:
        total, normed = fused_add_rms_norm(h, delta, norm_w, eps)
    return total, projection(normed.reshape(b, -1), w, bias)


def norm_router(h: torch.Tensor, delta: torch.Tensor, norm_w: torch.Tensor, eps: float,
                router_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MoE layer's input in a fused one-token step: h, delta [B, 1, H] -> (h + delta, its norm
    x [B, 1, H], which the experts read, and the router's logits [B, E]). One launch at up to
    MAX_ROWS rows; else the add-norm kernel, then the router's linear layer as
    `decode_linear.linear` runs it (cuBLAS beyond MAX_ROWS rows)."""
    b = h.shape[0]
    h2 = h.reshape(b, -1)
    if _fits(h2, router_w, MAX_ROWS):
        total, normed, logits = _launch(h2, delta.reshape(b, -1), norm_w, eps, router_w, None, True)
        return total.view(h.shape), normed.view(h.shape), logits
    total, normed = fused_add_rms_norm(h, delta, norm_w, eps)
    return total, normed, linear(normed.reshape(b, -1), router_w)


def norm_linear_twin(h, delta, norm_w, eps, w, bias=None):
    """The specification of both fusions' first part: (h + delta, its norm, the norm's product)."""
    total, normed = add_rms_norm(h, delta, norm_w, eps) if delta is not None else (h, rms_norm(h, norm_w, eps))
    return total, normed, linear_twin(normed, w, bias)
