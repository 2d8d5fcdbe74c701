"""Fused decode attention: one token per sequence attends over its paged keys.

Shape legend: B sequences (one new token each), Hq query heads, Hkv key/value heads, G = Hq/Hkv
query heads per key/value head, D head dim, Lk the attended key length (the step's key bucket),
S key splits, W = (Hq + 2*Hkv) * D the fused projection's width, P*Z pool positions.

Why: the reference decode attention is ~20 launches a layer (q/k norms, two rotaries, two
index copies into the pool, two gathers out of it, the mask, and SDPA's math path, which is
what runs for a boolean mask with grouped heads). Inside a CUDA graph each launch has a fixed
cost whatever its size, which made this most of a decode step's dense time. Here it is two launches
(three when the keys are split):
  1. `qkv_prep`: per (token, head) of the fused q/k/v projection: the optional per-head RMSNorm
     (Qwen3), the rotary embedding, then q into a [B, Hq, D] buffer and k, v straight into the
     pool at the token's position;
  2. `decode_attention`: per (sequence, kv head, key split): the G query heads of the group
     against the keys 0..position, read through the step's read index (flash-decoding online
     softmax in fp32); with S > 1 a third kernel combines the splits.

Twins: `qkv_prep_reference` applies the engine's own reference ops (`rms_norm`, `Rotary.apply`,
an index copy) and the kernel follows their rounding points, so q, k and v agree within the
norm's one bf16 ulp (passed through the rotary's three roundings) and v is copied exactly.
`decode_attention_reference` is fp32 masked softmax attention rounded once; the kernel rounds
the probabilities to the activation dtype before the PV product, as flash attention does, and
splits the sums, so the two agree within the tolerance registered in kernels/specs/dense.py.
The split count depends only on (B, Hkv, Lk), so the same step gives the same bits in eager and
captured decode alike.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton import pdl
from freetoken.kernels.triton.rotary import normed_rotated
from freetoken.kernels.triton.rounding import round_activation, store_rounded
from freetoken.reference.norms import offset_rms_norm, rms_norm
from freetoken.reference.rotary import Rotary

MIN_KEYS_PER_SPLIT = 128  # below this a split's fixed cost (q load, partial write) dominates
TARGET_PROGRAMS = 256  # ~2 programs per SM on a 132-SM GPU


@triton.jit
def _qkv_prep_kernel(
    qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, write_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    HQ, HKV, D, ROT, W, eps,
    BLOCK_D: tl.constexpr, NORM: tl.constexpr, OFFSET: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr,
):
    pdl.enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # 0..HQ-1 query heads, then HQ..HQ+HKV-1 key/value heads
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    half = ROT // 2  # the rotary turns dims 0..ROT-1 (all D but for a partial rotary)
    partner = tl.where(d < half, d + half, tl.where(d < ROT, d - half, d))
    turned = d < ROT
    c = tl.load(cos_ptr + token * ROT + d, mask=turned, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + token * ROT + d, mask=turned, other=0.0).to(tl.float32)
    row_ptr = qkv_ptr + token * W + head * D  # q heads, then k heads: head h starts at column h*D
    r = 1.0
    if NORM:
        x = tl.load(row_ptr + d, mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
    if head < HQ:
        y = normed_rotated(row_ptr, d, partner, mask, q_norm_ptr, c, s, r, ROT, NORM, BF16, OFFSET)
        store_rounded(q_out_ptr + (token * HQ + head) * D + d, y, mask, BF16)
    else:
        kv_head = head - HQ
        y = normed_rotated(row_ptr, d, partner, mask, k_norm_ptr, c, s, r, ROT, NORM, BF16, OFFSET)
        at = tl.load(write_ptr + token) * (HKV * D) + kv_head * D
        store_rounded(k_cache_ptr + at + d, y, mask, BF16)
        v = tl.load(qkv_ptr + token * W + (HQ + HKV) * D + kv_head * D + d, mask=mask)
        tl.store(v_cache_ptr + at + d, v, mask=mask)


def qkv_prep(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
    eps: float, cos: torch.Tensor, sin: torch.Tensor, write_index: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, rotary_dim: int | None = None, offset_norm: bool = False,
) -> torch.Tensor:
    """qkv [N, W] (q heads, then k heads, then v heads), cos/sin [N, R], write_index [N] pool
    positions, k_cache/v_cache [P*Z, Hkv, D] (one layer, written in place); q_norm/k_norm [D]
    per-head norm weights or None -> q [N, Hq, D]. rotary_dim R: the rotary turns each head's
    first R dims (even, default D: Qwen3.5's partial rotary turns a quarter); offset_norm: the
    norm weights are stored zero-centred (Qwen3.5/Next: times 1 + w, rounded once)."""
    n, width = qkv.shape
    D = k_cache.shape[-1]
    rot = D if rotary_dim is None else rotary_dim
    if width != (num_heads + 2 * num_kv_heads) * D or rot % 2 or not 0 < rot <= D:
        raise ValueError(f"qkv width {width} is not ({num_heads} + 2*{num_kv_heads}) heads of {D}, "
                         f"or the rotary's {rot} dims are not an even count within them")
    if cos.shape != (n, rot) or sin.shape != (n, rot) or write_index.shape != (n,):
        raise ValueError(f"cos/sin must be [N, {rot}] and write_index [N]")
    if qkv.dtype not in (torch.bfloat16, torch.float32) or k_cache.dtype != qkv.dtype:
        raise ValueError(f"qkv_prep takes bfloat16 or float32 throughout, got {qkv.dtype}/{k_cache.dtype}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    if write_index.dtype != torch.int64:
        raise ValueError(f"write_index must be int64 (pool offsets), got {write_index.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV pool layer must be contiguous")
    norm = q_norm is not None
    qkv = qkv.contiguous()
    q = torch.empty((n, num_heads, D), dtype=qkv.dtype, device=qkv.device)
    _qkv_prep_kernel[(n, num_heads + num_kv_heads)](
        qkv, q_norm if norm else qkv, k_norm if norm else qkv, cos.contiguous(), sin.contiguous(),
        write_index.contiguous(), q, k_cache, v_cache, num_heads, num_kv_heads, D, rot, width, eps,
        BLOCK_D=triton.next_power_of_2(D), NORM=norm, OFFSET=offset_norm, BF16=qkv.dtype == torch.bfloat16,
        num_warps=1, enable_fp_fusion=False, **pdl.launch(qkv),  # the twins round each product before the sum
    )
    return q


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, index_ptr, pos_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
    Lk, keys_per_split, scale, HQ, HKV, G, D,
    G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
    BF16: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    pdl.enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    length = tl.minimum(tl.load(pos_ptr + b) + 1, Lk)  # keys 0..position (never past the read index's row)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, length)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    heads = b * HQ + j * G + g  # [G_PAD] flat query heads of this group
    q_mask = (g < G)[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=q_mask, other=0.0).to(tl.float32)  # [G_PAD, BLOCK_D]
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        pos = tl.load(index_ptr + b * Lk + n, mask=n_mask, other=0)
        offs = pos[:, None] * (HKV * D) + j * D + d[None, :]  # [BLOCK_N, BLOCK_D]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = tl.where(n_mask[None, :], scores * scale, float("-inf"))  # [G_PAD, BLOCK_N]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(round_activation(p, BF16), v, input_precision=PRECISION)
        m = m_new
    if SPLIT:
        part = heads * num_splits + split
        tl.store(m_ptr + part, m, mask=g < G)
        tl.store(l_ptr + part, l, mask=g < G)
        tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=q_mask)
    else:
        store_rounded(out_ptr + heads[:, None] * D + d[None, :], acc / l[:, None], q_mask, BF16)


@triton.jit
def _combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, S, D,
                    S_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    head = tl.program_id(0).to(tl.int64)  # flat (b, query head)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < S
    m = tl.load(m_ptr + head * S + s, mask=s_mask, other=float("-inf"))
    l = tl.load(l_ptr + head * S + s, mask=s_mask, other=0.0)
    top = tl.max(m, axis=0)  # split 0 always holds key 0, so this is finite
    w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)  # [S_PAD]
    acc = tl.load(acc_ptr + (head * S + s)[:, None] * D + d[None, :], mask=s_mask[:, None] & (d < D)[None, :],
                  other=0.0)
    store_rounded(out_ptr + head * D + d, tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0), d < D, BF16)


def num_key_splits(batch: int, kv_heads: int, key_len: int) -> int:
    """Key splits of a step: enough programs to fill the GPU, each split at least
    MIN_KEYS_PER_SPLIT keys. A function of the shape only (graphs and eager agree)."""
    most = max(1, key_len // MIN_KEYS_PER_SPLIT)
    return max(1, min(most, TARGET_PROGRAMS // max(1, batch * kv_heads)))


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, read_index: torch.Tensor,
    positions: torch.Tensor, scale: float | None = None, splits: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D]; k_cache/v_cache [P*Z, Hkv, D] (one layer); read_index [B, Lk] pool positions
    of each sequence's keys; positions [B] or [B, 1] the new token's position (keys 0..position
    are attended, the rest of the Lk masked; callers size Lk above every position, and a
    position past it attends the Lk keys it has) -> [B, Hq*D]. scale: default 1/sqrt(D)."""
    B, hq, D = q.shape
    hkv = k_cache.shape[1]
    Lk = read_index.shape[1]
    if hq % hkv or k_cache.shape[2] != D or v_cache.shape != k_cache.shape or read_index.shape[0] != B:
        raise ValueError(f"q {tuple(q.shape)}, keys {tuple(k_cache.shape)}, read index {tuple(read_index.shape)}")
    if q.dtype != k_cache.dtype or q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"decode_attention takes bfloat16 or float32 throughout, got {q.dtype}/{k_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV pool layer must be contiguous")
    positions = positions.reshape(B)
    if positions.shape != (B,):
        raise ValueError("one position per sequence")
    if read_index.dtype != torch.int64 or positions.dtype != torch.int64:
        raise ValueError(f"read_index and positions must be int64, got {read_index.dtype}/{positions.dtype}")
    group = hq // hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    S = splits or num_key_splits(B, hkv, Lk)
    per_split = -(-Lk // S)
    out = torch.empty((B, hq * D), dtype=q.dtype, device=q.device)
    block_d = max(16, triton.next_power_of_2(D))
    meta = dict(G_PAD=max(16, triton.next_power_of_2(group)), BLOCK_N=64 if D <= 128 else 32, BLOCK_D=block_d,
                SPLIT=S > 1, BF16=q.dtype == torch.bfloat16,
                # bf16 operands (and probabilities rounded to bf16) are exact in tf32: tensor cores
                # at bf16's precision, and the interpreter (whose bf16 dot is wrong) computes the same.
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **pdl.launch(q))
    q, read_index = q.contiguous(), read_index.contiguous()
    if S == 1:
        _attention_kernel[(B, hkv, 1)](q, k_cache, v_cache, read_index, positions, out, out, out, out,
                                       Lk, per_split, scale, hq, hkv, group, D, **meta)
        return out
    m = torch.empty((B * hq, S), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((B * hq, S, D), dtype=torch.float32, device=q.device)
    _attention_kernel[(B, hkv, S)](q, k_cache, v_cache, read_index, positions, out, m, l, acc,
                                   Lk, per_split, scale, hq, hkv, group, D, **meta)
    _combine_kernel[(B * hq,)](m, l, acc, out, S, D, S_PAD=triton.next_power_of_2(S), BLOCK_D=block_d,
                               BF16=meta["BF16"], **pdl.launch(q))
    return out


# -- twins --------------------------------------------------------------------------------------
def qkv_prep_reference(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
    eps: float, cos: torch.Tensor, sin: torch.Tensor, write_index: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, rotary_dim: int | None = None, offset_norm: bool = False,
) -> torch.Tensor:
    """`qkv_prep` through the reference ops (reference/norms.py, reference/rotary.py), a partial
    rotary as models/families/qwen3_5.py applies it (the first dims turned, the rest kept)."""
    n = qkv.shape[0]
    D = k_cache.shape[-1]
    rot = D if rotary_dim is None else rotary_dim
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    q, k, v = q.reshape(1, n, num_heads, D), k.reshape(1, n, num_kv_heads, D), v.reshape(n, num_kv_heads, D)
    if q_norm is not None:
        norm = offset_rms_norm if offset_norm else rms_norm
        q, k = norm(q, q_norm, eps), norm(k, k_norm, eps)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([Rotary.apply(x[..., :rot].contiguous(), cos[None], sin[None]), x[..., rot:]], dim=-1)

    q, k = rotate(q), rotate(k)
    k_cache.index_copy_(0, write_index, k[0])
    v_cache.index_copy_(0, write_index, v)
    return q[0]


def decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, read_index: torch.Tensor,
    positions: torch.Tensor, scale: float | None = None,
) -> torch.Tensor:
    """`decode_attention` in fp32: masked softmax attention, rounded once to q's dtype."""
    B, hq, D = q.shape
    hkv = k_cache.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    keys = k_cache[read_index].float().repeat_interleave(hq // hkv, dim=2)  # [B, Lk, Hq, D]
    values = v_cache[read_index].float().repeat_interleave(hq // hkv, dim=2)
    scores = torch.einsum("bhd,bkhd->bhk", q.float(), keys) * scale  # [B, Hq, Lk]
    key_pos = torch.arange(read_index.shape[1], device=q.device)
    scores = scores.masked_fill(key_pos[None, None, :] > positions.reshape(B, 1, 1), float("-inf"))
    out = torch.einsum("bhk,bkhd->bhd", torch.softmax(scores, dim=-1), values)
    return out.reshape(B, hq * D).to(q.dtype)
