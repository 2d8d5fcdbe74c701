"""The GGUF row dots of `quant_dots.py` in explicit SIMD vectors (`block_vectors.py`).

Same blocks, same int16 vector codes, same exact integer sub-block sums: only the order of the
fp32 scale products and additions differs from the scalar dots (which stay as their twins and as
the fallback for rows of other strides). A block's codes are unpacked 32 at a time into int16
lanes and multiply-added with the vector codes (pmaddwd: 16 x 16 -> 32-bit pair sums); `sums8`
turns 8 sub-blocks' partial sums into one vector of their 8 totals, whose scales, steps (and for
Q4_K/Q5_K mins and code sums) are applied lane by lane in fp32 into a vector accumulator that is
summed once per row.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from freetoken.kernels.cpu import quant_dots
from freetoken.kernels.cpu.block_vectors import (
    f16_at,
    f16x8,
    fadd,
    fmul,
    fold,
    fsub,
    fsum,
    high_half,
    high_nibbles,
    k4_mins,
    k4_scales,
    load_f32x4_twice,
    load_f32x8,
    load_i8x8_as_f32,
    load_i16x32,
    load_i32x8_as_f32,
    load_u8x32,
    low_half,
    low_nibbles,
    madd,
    minus,
    splat,
    sums8,
    to_f32,
    total,
    widen,
    with_high_bits,
)
from freetoken.kernels.cpu.experts import FASTMATH, _prefetch
from freetoken.kernels.cpu.quant_dots import Q4_K, Q5_K, Q6_K, Q8_0, dot_plain

# How far ahead of the row being dotted `dot_rows` prefetches. Measured single-threaded on a 2-core
# AMD EPYC guest (Q4_K and Q8_0 experts streamed from a pool 8x its L3): none, 4 KiB and 8 KiB took
# about 1.5x, 1.0x and 1.0x the time; 8 KiB leaves room for a host with slower memory.
PREFETCH_BYTES = 8192


@njit(inline="always")
def _sub_block(codes, xq, k):
    """8 lanes summing to sum(codes * xq[k:k + 32]) for 32 unsigned byte codes."""
    return fold(madd(widen(codes, False), load_i16x32(xq, k)))


@njit(fastmath=FASTMATH, inline="always")
def _k4_block(r, o, s, xd, xs, c):
    """A Q4_K/Q5_K block's 8 values (sub-block j in lane j) from its integer sums s; x chunks c..c+7:
    xd_j * (d * sc_j * s_j - dmin * m_j * xs_j)."""
    scaled = fmul(fmul(splat(f16_at(r, o)), k4_scales(r, o + 4)), to_f32(s))
    mins = fmul(fmul(splat(f16_at(r, o + 2)), k4_mins(r, o + 4)), load_i32x8_as_f32(xs, c))
    return fmul(fsub(scaled, mins), load_f32x8(xd, c))


@njit(fastmath=FASTMATH, inline="always")
def dot_q4_k(r, off, xq, xd, xs, n):
    """quant_dots.dot_q4_k: 32-byte run c's low nibbles are sub-block 2c, its high ones 2c + 1."""
    acc = splat(np.float32(0.0))
    for b in range(n // 256):
        o, k = off + 144 * b, 256 * b
        v0, v1, v2, v3 = load_u8x32(r, o + 16), load_u8x32(r, o + 48), load_u8x32(r, o + 80), load_u8x32(r, o + 112)
        s = sums8(_sub_block(low_nibbles(v0), xq, k), _sub_block(high_nibbles(v0), xq, k + 32),
                  _sub_block(low_nibbles(v1), xq, k + 64), _sub_block(high_nibbles(v1), xq, k + 96),
                  _sub_block(low_nibbles(v2), xq, k + 128), _sub_block(high_nibbles(v2), xq, k + 160),
                  _sub_block(low_nibbles(v3), xq, k + 192), _sub_block(high_nibbles(v3), xq, k + 224))
        acc = fadd(acc, _k4_block(r, o, s, xd, xs, 8 * b))
    return fsum(acc)


@njit(fastmath=FASTMATH, inline="always")
def dot_q5_k(r, off, xq, xd, xs, n):
    """quant_dots.dot_q5_k: Q4_K's nibbles, sub-block j's fifth bit in bit j of the 32 qh bytes."""
    acc = splat(np.float32(0.0))
    for b in range(n // 256):
        o, k = off + 176 * b, 256 * b
        h = load_u8x32(r, o + 16)
        v0, v1, v2, v3 = load_u8x32(r, o + 48), load_u8x32(r, o + 80), load_u8x32(r, o + 112), load_u8x32(r, o + 144)
        s = sums8(_sub_block(with_high_bits(low_nibbles(v0), h, 0, 1), xq, k),
                  _sub_block(with_high_bits(high_nibbles(v0), h, 1, 1), xq, k + 32),
                  _sub_block(with_high_bits(low_nibbles(v1), h, 2, 1), xq, k + 64),
                  _sub_block(with_high_bits(high_nibbles(v1), h, 3, 1), xq, k + 96),
                  _sub_block(with_high_bits(low_nibbles(v2), h, 4, 1), xq, k + 128),
                  _sub_block(with_high_bits(high_nibbles(v2), h, 5, 1), xq, k + 160),
                  _sub_block(with_high_bits(low_nibbles(v3), h, 6, 1), xq, k + 192),
                  _sub_block(with_high_bits(high_nibbles(v3), h, 7, 1), xq, k + 224))
        acc = fadd(acc, _k4_block(r, o, s, xd, xs, 8 * b))
    return fsum(acc)


@njit(inline="always")
def _q6_run(low, qh, shift, xq, k):
    """A run of 32 Q6_K codes minus 32 (two 16-value sub-blocks) multiply-added with xq[k:k + 32]."""
    return madd(minus(widen(with_high_bits(low, qh, shift, 3), False), 32), load_i16x32(xq, k))


@njit(fastmath=FASTMATH, inline="always")
def dot_q6_k(r, off, xq, xd, xs, n):
    """quant_dots.dot_q6_k: per half block, ql[0:32] and ql[32:64]'s low then high nibbles with
    2-bit pairs 0..3 of qh[0:32] are four runs of 32 values (one x chunk each)."""
    acc = splat(np.float32(0.0))
    for b in range(n // 256):
        o = off + 210 * b
        d = splat(f16_at(r, o + 208))
        for half in range(2):
            ql0, ql1 = load_u8x32(r, o + 64 * half), load_u8x32(r, o + 64 * half + 32)
            qh = load_u8x32(r, o + 128 + 32 * half)
            k = 256 * b + 128 * half
            p0, p1 = _q6_run(low_nibbles(ql0), qh, 0, xq, k), _q6_run(low_nibbles(ql1), qh, 2, xq, k + 32)
            p2, p3 = _q6_run(high_nibbles(ql0), qh, 4, xq, k + 64), _q6_run(high_nibbles(ql1), qh, 6, xq, k + 96)
            s = sums8(low_half(p0), high_half(p0), low_half(p1), high_half(p1), low_half(p2), high_half(p2),
                      low_half(p3), high_half(p3))
            scaled = fmul(fmul(d, load_i8x8_as_f32(r, o + 192 + 8 * half)), to_f32(s))
            acc = fadd(acc, fmul(scaled, load_f32x4_twice(xd, 8 * b + 4 * half)))
    return fsum(acc)


@njit(inline="always")
def _q8_block(r, o, xq, k):
    """8 lanes summing to one Q8_0 block's sum(q * xq[k:k + 32]) (its int8 codes at r[o + 2:])."""
    return fold(madd(widen(load_u8x32(r, o + 2), True), load_i16x32(xq, k)))


@njit(fastmath=FASTMATH, inline="always")
def dot_q8_0(r, off, xq, xd, n):
    """quant_dots.dot_q8_0: eight blocks a step (their f16 scales gathered into one vector), then
    single blocks for the rest of the row."""
    acc = splat(np.float32(0.0))
    octets = n // 256
    for g in range(octets):
        o, k = off + 272 * g, 256 * g
        s = sums8(_q8_block(r, o, xq, k), _q8_block(r, o + 34, xq, k + 32), _q8_block(r, o + 68, xq, k + 64),
                  _q8_block(r, o + 102, xq, k + 96), _q8_block(r, o + 136, xq, k + 128),
                  _q8_block(r, o + 170, xq, k + 160), _q8_block(r, o + 204, xq, k + 192),
                  _q8_block(r, o + 238, xq, k + 224))
        acc = fadd(acc, fmul(fmul(f16x8(r, o, 34), load_f32x8(xd, 8 * g)), to_f32(s)))
    tail = np.float32(0.0)
    for b in range(8 * octets, n // 32):
        o = off + 34 * b
        tail += f16_at(r, o) * xd[b] * np.float32(total(_q8_block(r, o, xq, 32 * b)))
    return fsum(acc) + tail


@njit(fastmath=FASTMATH)
def dot_rows(r, off, rb, qtype, x, xq, xd, xs, out):
    """out[k] = quant_dots.dot_row(r, off + k * rb, qtype, x, xq, xd, xs) for k < len(out): rows
    rb bytes apart, one format, one vector (the row dots are inlined here, so a row costs its
    blocks only). Each row first prefetches the bytes PREFETCH_BYTES past its own: one row at a
    time is too short a stream for the hardware prefetcher to reach DRAM's rate. Vector loads
    read consecutive bytes, so rows of another stride take the scalar dots."""
    n = x.shape[0]
    for k in range(out.shape[0]):
        o = off + k * rb
        if r.strides[0] != 1:
            out[k] = quant_dots.dot_row(r, o, qtype, x, xq, xd, xs)
            continue
        for line in range(0, rb, 64):
            _prefetch(r, o + PREFETCH_BYTES + line)
        if qtype == Q4_K:
            out[k] = dot_q4_k(r, o, xq, xd, xs, n)
        elif qtype == Q6_K:
            out[k] = dot_q6_k(r, o, xq, xd, xs, n)
        elif qtype == Q8_0:
            out[k] = dot_q8_0(r, o, xq, xd, n)
        elif qtype == Q5_K:
            out[k] = dot_q5_k(r, o, xq, xd, xs, n)
        else:
            out[k] = dot_plain(r, o, x, n, qtype)


@njit(fastmath=FASTMATH)
def dot_row(r, off, qtype, x, xq, xd, xs):
    """quant_dots.dot_row through the vector dots (`dot_rows` of one row)."""
    out = np.empty(1, np.float32)
    dot_rows(r, off, 0, qtype, x, xq, xd, xs, out)
    return out[0]
