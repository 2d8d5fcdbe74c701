"""The gated delta rule of Qwen3-Next / Qwen3.5's linear attention on the device: a one-token
recurrent kernel for decode and a chunked (WY / UT) pair of kernels for prefill.

Shape legend: B sequences, T tokens per sequence, HK key heads, each serving HV / HK value heads
(value head h reads key head h // (HV / HK): no repeated copy of q and k), DK key dim, DV value
dim, S state slots, BT the 64-token chunk, NT chunks per sequence.
Twin: `freetoken.reference.gated_delta.gated_delta_rule` (the token-by-token recurrence in fp32);
pairs in kernels/specs/linear_attention.py. The state is fp32 in a pool indexed by `slots` and
updated in place, so a captured CUDA graph replays a step on whichever sequences hold the slots;
the slots one call writes must be distinct (two programs writing one slot would race); a negative
slot -(s + 1) is a read-only row (reference/gated_delta.py).

Recurrent (`gated_delta_recurrent`, decode): one program per (sequence, value head, DV block)
holds its [DK, BLOCK_V] slice of the state in registers, loops over the T tokens and writes the
slice back once. Each program normalises q and k itself: recomputing a 128-vector norm is cheaper
than a launch.

Chunked (`gated_delta_chunked`, prefill): the chunk's T delta-rule updates collapse into the unit
lower triangular system (I + A) with A[i, j] = beta_i k_i.k_j exp(gc_i - gc_j) for j < i (gc the
cumulative log decay in the chunk). A first kernel, parallel over chunks, inverts it and writes
U = (I + A)^-1 (beta v) and W = (I + A)^-1 (beta exp(gc) k) to fp32 scratch; a second, sequential
over chunks and parallel over (sequence, head, DV block), carries the state:
    v_new = U - W S;  out = (q exp(gc)) S + mask(q k^T exp(gc_i - gc_j)) v_new;
    S <- S exp(gc_last) + (k exp(gc_last - gc))^T v_new.
The inverse is blocked forward substitution in fp32 (16 sequential steps, then two block merges):
the power series (I - N)(I + N^2)... would need fewer steps, but its intermediate powers grow far
past the inverse's entries and cancel.

Ours, not the `fla` library's: no extra dependency for two kernels; the state is read from and
written to a slot pool in place, which graph capture needs and fla's initial/final-state tensors
are not; and these kernels sit under the same Hypothesis pairs against a twin as every other one.

Dots run with `DOT_PRECISION`: three TF32 products per fp32 product keep fp32's accuracy on the
tensor cores (plain TF32 keeps 10 mantissa bits, and the state carries its error across chunks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton.rounding import store_rounded
from freetoken.reference.gated_delta import L2_EPS, check_gated_delta_inputs

CHUNK = 64
DOT_PRECISION = "tf32x3"


@triton.jit
def _l2_normalize_rows(x, eps):
    """x [R, D] fp32 -> each row over sqrt(sum x^2 + eps)."""
    return x * (1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) + eps))[:, None]


@triton.jit
def _unit_lower_inverse(a, rows, cols, PRECISION: tl.constexpr):
    """(I + a)^-1 for a [64, 64] strictly lower triangular: the 16-row diagonal blocks by forward
    substitution, four at once, then merged twice: with D the inverse of the diagonal blocks and E
    the part of a below them, (D^-1 + E)^-1 = D - D E D, since E D E = 0 for one level of blocks."""
    tl.static_assert(a.shape[0] == 64)
    eye = tl.where(rows == cols, 1.0, 0.0)
    in_16 = rows // 16 == cols // 16
    a_16 = tl.where(in_16, a, 0.0)
    inverse = eye
    for i in range(1, 16):  # row i of each block: e_i - sum_{j<i} a[i, j] row j (rows below i still e_j)
        inverse = tl.where(rows % 16 == i, eye - tl.dot(a_16, inverse, input_precision=PRECISION), inverse)
    in_32 = rows // 32 == cols // 32
    inverse = _merge_blocks(inverse, tl.where(in_32 & ~in_16, a, 0.0), PRECISION)  # 16-row blocks -> 32
    return _merge_blocks(inverse, tl.where(in_32, 0.0, a), PRECISION)  # 32-row blocks -> 64


@triton.jit
def _merge_blocks(inverse, below, PRECISION: tl.constexpr):
    return inverse - tl.dot(tl.dot(inverse, below, input_precision=PRECISION), inverse, input_precision=PRECISION)


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, out_ptr, T, HV, GROUP, DK, DV,
                      sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, sb_b, sb_t, sb_h,
                      scale, eps, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, OUT_BF16: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    kh = h // GROUP  # the key head serving value head h
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    slot = tl.load(slots_ptr + b)
    writes = slot >= 0  # (a read-only row, -(s + 1), starts from slot s and writes nothing)
    row = tl.where(writes, slot, -slot - 1)
    state_ptrs = state_ptr + ((row * HV + h) * DK + offs_k[:, None]) * DV + offs_v[None, :]
    mask_s = mask_k[:, None] & mask_v[None, :]
    state = tl.load(state_ptrs, mask=mask_s, other=0.0)  # [BLOCK_K, BLOCK_V]
    for t in range(T):
        q = tl.load(q_ptr + b * sq_b + t * sq_t + kh * sq_h + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b * sk_b + t * sk_t + kh * sk_h + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + b * sv_b + t * sv_t + h * sv_h + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + b * sg_b + t * sg_t + h * sg_h).to(tl.float32)
        beta = tl.load(beta_ptr + b * sb_b + t * sb_t + h * sb_h).to(tl.float32)
        q = q * (1.0 / tl.sqrt_rn(tl.sum(q * q, axis=0) + eps)) * scale
        k = k * (1.0 / tl.sqrt_rn(tl.sum(k * k, axis=0) + eps))
        state = state * tl.exp(g)
        delta = (v - tl.sum(state * k[:, None], axis=0)) * beta  # [BLOCK_V]
        state = state + k[:, None] * delta[None, :]
        out = tl.sum(state * q[:, None], axis=0)
        store_rounded(out_ptr + ((b * T + t) * HV + h) * DV + offs_v, out, mask_v, OUT_BF16)
    tl.store(state_ptrs, state, mask=mask_s & writes)


@triton.jit
def _chunk_prepare_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, u_ptr, w_ptr, gc_ptr, T, T_PAD, HV, GROUP, DK, DV,
                          sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, sb_b, sb_t, sb_h, eps,
                          BT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                          PRECISION: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // HV, bh % HV
    kh = h // GROUP  # the key head serving value head h
    offs_t = tl.program_id(1) * BT + tl.arange(0, BT)
    offs_k, offs_v, offs_c = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V), tl.arange(0, BT)
    mask_t = offs_t < T
    mask_tk = mask_t[:, None] & (offs_k[None, :] < DK)
    mask_tv = mask_t[:, None] & (offs_v[None, :] < DV)
    k = tl.load(k_ptr + b * sk_b + offs_t[:, None] * sk_t + kh * sk_h + offs_k[None, :], mask=mask_tk,
                other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * sv_b + offs_t[:, None] * sv_t + h * sv_h + offs_v[None, :], mask=mask_tv,
                other=0.0).to(tl.float32)
    # padded tokens: g = 0 keeps the decay flat, beta = 0 and k = 0 make them write nothing
    g = tl.load(g_ptr + b * sg_b + offs_t * sg_t + h * sg_h, mask=mask_t, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + b * sb_b + offs_t * sb_t + h * sb_h, mask=mask_t, other=0.0).to(tl.float32)
    k = _l2_normalize_rows(k, eps)
    gc = tl.cumsum(g, axis=0)  # [BT]
    rows, cols = offs_c[:, None], offs_c[None, :]
    below = cols < rows
    k_beta = k * beta[:, None]
    decay = tl.exp(tl.where(below, gc[:, None] - gc[None, :], 0.0))  # masked first: exp of a rise overflows
    a = tl.where(below, tl.dot(k_beta, tl.trans(k), input_precision=PRECISION) * decay, 0.0)  # [BT, BT]
    inverse = _unit_lower_inverse(a, rows, cols, PRECISION)
    u = tl.dot(inverse, v * beta[:, None], input_precision=PRECISION)  # [BT, BLOCK_V]
    w = tl.dot(inverse, k_beta * tl.exp(gc)[:, None], input_precision=PRECISION)  # [BT, BLOCK_K]
    pad_t = tl.program_id(1) * BT + offs_c  # scratch rows: every chunk row, padding included
    tl.store(u_ptr + (bh * T_PAD + pad_t[:, None]) * DV + offs_v[None, :], u, mask=offs_v[None, :] < DV)
    tl.store(w_ptr + (bh * T_PAD + pad_t[:, None]) * DK + offs_k[None, :], w, mask=offs_k[None, :] < DK)
    tl.store(gc_ptr + bh * T_PAD + pad_t, gc)


@triton.jit
def _chunk_scan_kernel(q_ptr, k_ptr, u_ptr, w_ptr, gc_ptr, state_ptr, slots_ptr, out_ptr, T, T_PAD, HV, GROUP, DK,
                       DV,
                       sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, scale, eps, BT: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_V: tl.constexpr, OUT_BF16: tl.constexpr, PRECISION: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // HV, bh % HV
    kh = h // GROUP  # the key head serving value head h
    offs_k, offs_c = tl.arange(0, BLOCK_K), tl.arange(0, BT)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    slot = tl.load(slots_ptr + b)
    writes = slot >= 0  # (a read-only row, -(s + 1), starts from slot s and writes nothing)
    row = tl.where(writes, slot, -slot - 1)
    state_ptrs = state_ptr + ((row * HV + h) * DK + offs_k[:, None]) * DV + offs_v[None, :]
    mask_s = mask_k[:, None] & mask_v[None, :]
    state = tl.load(state_ptrs, mask=mask_s, other=0.0)  # [BLOCK_K, BLOCK_V]
    causal = offs_c[None, :] <= offs_c[:, None]
    for c in range(tl.cdiv(T, BT)):
        offs_t = c * BT + offs_c
        mask_t = offs_t < T
        mask_tk = mask_t[:, None] & mask_k[None, :]
        q = tl.load(q_ptr + b * sq_b + offs_t[:, None] * sq_t + kh * sq_h + offs_k[None, :], mask=mask_tk,
                    other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b * sk_b + offs_t[:, None] * sk_t + kh * sk_h + offs_k[None, :], mask=mask_tk,
                    other=0.0).to(tl.float32)
        q = _l2_normalize_rows(q, eps) * scale
        k = _l2_normalize_rows(k, eps)
        scratch = bh * T_PAD + offs_t
        gc = tl.load(gc_ptr + scratch)  # [BT]
        gc_last = tl.load(gc_ptr + bh * T_PAD + c * BT + BT - 1)
        w = tl.load(w_ptr + scratch[:, None] * DK + offs_k[None, :], mask=mask_k[None, :], other=0.0)
        u = tl.load(u_ptr + scratch[:, None] * DV + offs_v[None, :], mask=mask_v[None, :], other=0.0)
        v_new = u - tl.dot(w, state, input_precision=PRECISION)  # [BT, BLOCK_V]
        decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0))
        attn = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay, 0.0)  # [BT, BT]
        out = (tl.dot(q * tl.exp(gc)[:, None], state, input_precision=PRECISION)
               + tl.dot(attn, v_new, input_precision=PRECISION))
        store_rounded(out_ptr + ((b * T + offs_t[:, None]) * HV + h) * DV + offs_v[None, :], out,
                      mask_t[:, None] & mask_v[None, :], OUT_BF16)
        k_rest = k * tl.exp(gc_last - gc)[:, None]
        state = state * tl.exp(gc_last) + tl.dot(tl.trans(k_rest), v_new, input_precision=PRECISION)
    tl.store(state_ptrs, state, mask=mask_s & writes)


def _check(q, k, v, g, beta, state_pool, slots) -> None:
    check_gated_delta_inputs(q, k, v, g, beta, state_pool, slots)
    if v.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"gated_delta_rule: v is {v.dtype}; bfloat16 or float32 expected")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(3) != 1:
            raise ValueError(f"gated_delta_rule: {name}'s last dim must be contiguous, strides {t.stride()}")
    if not state_pool.is_contiguous():
        raise ValueError("gated_delta_rule: state_pool must be contiguous")
    devices = {t.device for t in (q, k, v, g, beta, state_pool, slots)}
    if len(devices) != 1:
        raise ValueError(f"gated_delta_rule: the arguments are on several devices {sorted(map(str, devices))}")


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot takes no dim under 16


def gated_delta_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The token-by-token kernel (the decode path; any T), same arguments and result as the twin."""
    _check(q, k, v, g, beta, state_pool, slots)
    B, T, HK, DK = q.shape
    HV, DV = v.shape[2:]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # [B, T, HV, DV]
    block_v = min(32, _block(DV))  # DV / 32 programs per head: enough of them at a decode batch of one
    grid = (B, HV, triton.cdiv(DV, block_v))
    _recurrent_kernel[grid](q, k, v, g, beta, state_pool, slots, out, T, HV, HV // HK, DK, DV,
                            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(),
                            DK**-0.5, L2_EPS, BLOCK_K=_block(DK), BLOCK_V=block_v,
                            OUT_BF16=v.dtype == torch.bfloat16, num_warps=4)
    return out


def gated_delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The chunked kernels (the prefill path; any T), same arguments and result as the twin."""
    _check(q, k, v, g, beta, state_pool, slots)
    B, T, HK, DK = q.shape
    HV, DV = v.shape[2:]
    chunks = triton.cdiv(T, CHUNK)
    t_pad = chunks * CHUNK
    u = torch.empty(B * HV, t_pad, DV, dtype=torch.float32, device=v.device)
    w = torch.empty(B * HV, t_pad, DK, dtype=torch.float32, device=v.device)
    gc = torch.empty(B * HV, t_pad, dtype=torch.float32, device=v.device)
    block_k = _block(DK)
    _chunk_prepare_kernel[(B * HV, chunks)](k, v, g, beta, u, w, gc, T, t_pad, HV, HV // HK, DK, DV,
                                            *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(), L2_EPS,
                                            BT=CHUNK, BLOCK_K=block_k, BLOCK_V=_block(DV), PRECISION=DOT_PRECISION,
                                            num_warps=8)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # [B, T, HV, DV]
    block_v = min(32, _block(DV))
    # one pipeline stage: the chunk loop's fp32 tiles, buffered for more, need more shared memory than an SM has
    _chunk_scan_kernel[(B * HV, triton.cdiv(DV, block_v))](
        q, k, u, w, gc, state_pool, slots, out, T, t_pad, HV, HV // HK, DK, DV, *q.stride()[:3], *k.stride()[:3],
        DK**-0.5, L2_EPS, BT=CHUNK, BLOCK_K=block_k, BLOCK_V=block_v, OUT_BF16=v.dtype == torch.bfloat16,
        PRECISION=DOT_PRECISION, num_warps=4, num_stages=1)
    return out


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """q, k [B, T, HK, DK] (not yet normalised; HK divides HV); v [B, T, HV, DV]; g, beta [B, T, HV];
    state_pool [S, HV, DK, DV] fp32, rows `slots` [B] (distinct) read then overwritten -> out [B, T, HV, DV]
    in v's dtype. One token per sequence takes the recurrent kernel, more take the chunked ones."""
    rule = gated_delta_recurrent if q.shape[1] == 1 else gated_delta_chunked
    return rule(q, k, v, g, beta, state_pool, slots)
