"""Dot products of one GGUF-quantized row with an fp32 vector, decoded in registers (Numba).

A row is consecutive blocks of its type (Q8_0: 32 values in 34 bytes, f16 d then int8 q, value
d*q; Q4_K/Q5_K: 256 values as 8 sub-blocks of 32, each with a 6-bit scale and min, value
d*sc*q - dmin*m; Q6_K: 256 values as 16 sub-blocks of 16, int8 scale, value d*sc*(q - 32);
F32/F16/BF16: plain values). No dequantized row is ever written.

Why the loops look the way they do (all of it is for LLVM's vectoriser):
  - one loop per block (per half block for Q6_K, per four blocks for Q8_0) whose lane l touches
    every sub-block's l-th value, so each sub-block's scale and min are loop-invariant scalars
    (folded to w = f*q - g, two FMAs a value) and the vector partial sums are reduced once a
    block, not once a sub-block;
  - two accumulators per loop, so the FMA chains are half as long;
  - a block is a slice of the row and the loop index a constant range, so every index is known
    non-negative and Numba's negative-index wraparound folds away (loads stay contiguous);
  - every bit operation is truncated back to int32 (Numba widens integer arithmetic to int64),
    so nibbles and high bits are taken out in narrow lanes.
Applying a sub-block's scale to each value rather than to its integer-weighted sum is a
different rounding order of the same fp32 products; the bound against the fp32 twin is the one
in `quant_experts.py`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from freetoken.kernels.cpu.experts import FASTMATH

# GGUF type ids of the formats read here.
F32, F16, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 8, 12, 13, 14, 30

_M2, _M3, _M15 = np.int32(1), np.int32(3), np.int32(15)


@njit(fastmath=FASTMATH, inline="always")
def _f16(lo, hi):
    """The fp32 value of a little-endian f16 from its two bytes (subnormals, inf and NaN too)."""
    h = np.uint32(np.uint32(lo) | np.uint32(np.uint32(hi) << np.uint32(8)))
    em = np.uint32(h & np.uint32(0x7FFF))
    # Shifted into fp32's place, the exponent is 112 short: scaling by 2**112 fixes normal and
    # subnormal values alike; inf and NaN keep an all-ones exponent.
    mag = np.uint32(em << np.uint32(13)).view(np.float32) * np.float32(5.192296858534828e33)
    if em >= np.uint32(0x7C00):
        mag = np.uint32(np.uint32(0x7F800000) | np.uint32(np.uint32(em & np.uint32(0x3FF)) << np.uint32(13))).view(
            np.float32)
    return np.float32(mag) if h < np.uint32(0x8000) else -np.float32(mag)


@njit(inline="always")
def _i8(b):
    """A byte read as int8."""
    return np.int32(np.int8(b))


@njit(inline="always")
def _nib_lo(v):
    return np.int32(v & _M15)


@njit(inline="always")
def _nib_hi(v):
    return np.int32(v >> np.int32(4))


@njit(inline="always")
def _lo(v):
    return np.float32(_nib_lo(v))


@njit(inline="always")
def _hi(v):
    return np.float32(_nib_hi(v))


@njit(inline="always")
def _bit(h, j):
    """Bit j of h as 16.0 or 0.0 (Q5_K's fifth bit, in place)."""
    return np.float32(np.int32(np.int32(np.int32(h >> np.int32(j)) & _M2) << np.int32(4)))


@njit(fastmath=FASTMATH, inline="always")
def _k4_scale_min(s, o, j, d, dmin):
    """Sub-block j's (d * scale, dmin * min) from the 12 packed 6-bit pairs at s[o:o + 12]."""
    if j < 4:
        sc, m = np.int32(s[o + j] & 63), np.int32(s[o + j + 4] & 63)
    else:
        sc = np.int32((s[o + j + 4] & 15) | ((s[o + j - 4] >> 6) << 4))
        m = np.int32((s[o + j + 4] >> 4) | ((s[o + j] >> 6) << 4))
    return d * np.float32(sc), dmin * np.float32(m)


@njit(fastmath=FASTMATH, inline="always")
def _k4_scales(blk):
    """The 8 sub-blocks' (d * scale) and (dmin * min) of a Q4_K/Q5_K block."""
    d = _f16(blk[0], blk[1])
    dmin = _f16(blk[2], blk[3])
    f0, g0 = _k4_scale_min(blk, 4, 0, d, dmin)
    f1, g1 = _k4_scale_min(blk, 4, 1, d, dmin)
    f2, g2 = _k4_scale_min(blk, 4, 2, d, dmin)
    f3, g3 = _k4_scale_min(blk, 4, 3, d, dmin)
    f4, g4 = _k4_scale_min(blk, 4, 4, d, dmin)
    f5, g5 = _k4_scale_min(blk, 4, 5, d, dmin)
    f6, g6 = _k4_scale_min(blk, 4, 6, d, dmin)
    f7, g7 = _k4_scale_min(blk, 4, 7, d, dmin)
    return (f0, f1, f2, f3, f4, f5, f6, f7), (g0, g1, g2, g3, g4, g5, g6, g7)


@njit(fastmath=FASTMATH)
def dot_q4_k(r, off, x, n):
    """Q4_K: byte l of 32-byte chunk c holds value 64c + l (low nibble, sub-block 2c) and
    64c + 32 + l (high nibble, sub-block 2c + 1)."""
    acc = np.float32(0.0)
    for b in range(n // 256):
        blk = r[off + 144 * b: off + 144 * b + 144]
        xb = x[256 * b: 256 * b + 256]
        (f0, f1, f2, f3, f4, f5, f6, f7), (g0, g1, g2, g3, g4, g5, g6, g7) = _k4_scales(blk)
        s = np.float32(0.0)
        t = np.float32(0.0)
        for l in range(32):
            v0, v1, v2, v3 = blk[16 + l], blk[48 + l], blk[80 + l], blk[112 + l]
            s += ((f0 * _lo(v0) - g0) * xb[l] + (f1 * _hi(v0) - g1) * xb[32 + l]
                  + (f2 * _lo(v1) - g2) * xb[64 + l] + (f3 * _hi(v1) - g3) * xb[96 + l])
            t += ((f4 * _lo(v2) - g4) * xb[128 + l] + (f5 * _hi(v2) - g5) * xb[160 + l]
                  + (f6 * _lo(v3) - g6) * xb[192 + l] + (f7 * _hi(v3) - g7) * xb[224 + l])
        acc += s + t
    return acc


@njit(fastmath=FASTMATH)
def dot_q5_k(r, off, x, n):
    """Q5_K: Q4_K's nibbles plus a fifth bit, bit j of qh[l] for sub-block j's value l."""
    acc = np.float32(0.0)
    for b in range(n // 256):
        blk = r[off + 176 * b: off + 176 * b + 176]
        xb = x[256 * b: 256 * b + 256]
        (f0, f1, f2, f3, f4, f5, f6, f7), (g0, g1, g2, g3, g4, g5, g6, g7) = _k4_scales(blk)
        s = np.float32(0.0)
        t = np.float32(0.0)
        for l in range(32):
            h = np.int32(blk[16 + l])
            v0, v1, v2, v3 = blk[48 + l], blk[80 + l], blk[112 + l], blk[144 + l]
            s += ((f0 * (_lo(v0) + _bit(h, 0)) - g0) * xb[l] + (f1 * (_hi(v0) + _bit(h, 1)) - g1) * xb[32 + l]
                  + (f2 * (_lo(v1) + _bit(h, 2)) - g2) * xb[64 + l]
                  + (f3 * (_hi(v1) + _bit(h, 3)) - g3) * xb[96 + l])
            t += ((f4 * (_lo(v2) + _bit(h, 4)) - g4) * xb[128 + l]
                  + (f5 * (_hi(v2) + _bit(h, 5)) - g5) * xb[160 + l]
                  + (f6 * (_lo(v3) + _bit(h, 6)) - g6) * xb[192 + l]
                  + (f7 * (_hi(v3) + _bit(h, 7)) - g7) * xb[224 + l])
        acc += s + t
    return acc


@njit(inline="always")
def _q6(low, h, j):
    """A Q6_K code 0..63 from its 4 low bits and bits 2j, 2j+1 of h, as fp32."""
    return np.float32(low | np.int32(np.int32(np.int32(h >> np.int32(2 * j)) & _M3) << np.int32(4)))


@njit(fastmath=FASTMATH)
def dot_q6_k(r, off, x, n):
    """Q6_K: each half block (128 values) is ql[64], qh[32] and 8 int8 scales; lane l of the
    loop takes values l and l + 16 of each of the half's four runs of 32."""
    acc = np.float32(0.0)
    for b in range(n // 256):
        blk = r[off + 210 * b: off + 210 * b + 210]
        d = _f16(blk[208], blk[209])
        for half in range(2):
            ql = blk[64 * half: 64 * half + 64]
            qh = blk[128 + 32 * half: 160 + 32 * half]
            sc = blk[192 + 8 * half: 200 + 8 * half]
            xb = x[256 * b + 128 * half: 256 * b + 128 * half + 128]
            f0, f1, f2, f3 = d * np.float32(_i8(sc[0])), d * np.float32(_i8(sc[1])), d * np.float32(
                _i8(sc[2])), d * np.float32(_i8(sc[3]))
            f4, f5, f6, f7 = d * np.float32(_i8(sc[4])), d * np.float32(_i8(sc[5])), d * np.float32(
                _i8(sc[6])), d * np.float32(_i8(sc[7]))
            # value = f * (q - 32): the offset folds into a constant per sub-block
            c = np.float32(32.0)
            s = np.float32(0.0)
            t = np.float32(0.0)
            for l in range(16):
                a, a2 = ql[l], ql[l + 16]
                e, e2 = ql[l + 32], ql[l + 48]
                h, h2 = qh[l], qh[l + 16]
                s += ((f0 * _q6(_nib_lo(a), h, 0) - c * f0) * xb[l]
                      + (f1 * _q6(_nib_lo(a2), h2, 0) - c * f1) * xb[l + 16]
                      + (f2 * _q6(_nib_lo(e), h, 1) - c * f2) * xb[l + 32]
                      + (f3 * _q6(_nib_lo(e2), h2, 1) - c * f3) * xb[l + 48])
                t += ((f4 * _q6(_nib_hi(a), h, 2) - c * f4) * xb[l + 64]
                      + (f5 * _q6(_nib_hi(a2), h2, 2) - c * f5) * xb[l + 80]
                      + (f6 * _q6(_nib_hi(e), h, 3) - c * f6) * xb[l + 96]
                      + (f7 * _q6(_nib_hi(e2), h2, 3) - c * f7) * xb[l + 112])
            acc += s + t
    return acc


@njit(fastmath=FASTMATH)
def dot_q8_0(r, off, x, n):
    """Q8_0, four blocks a loop (then single blocks for the rest of the row)."""
    acc = np.float32(0.0)
    quads = n // 128
    for b in range(quads):
        blk = r[off + 136 * b: off + 136 * b + 136]
        xb = x[128 * b: 128 * b + 128]
        d0, d1 = _f16(blk[0], blk[1]), _f16(blk[34], blk[35])
        d2, d3 = _f16(blk[68], blk[69]), _f16(blk[102], blk[103])
        s = np.float32(0.0)
        t = np.float32(0.0)
        for l in range(32):
            s += d0 * np.float32(_i8(blk[2 + l])) * xb[l] + d1 * np.float32(_i8(blk[36 + l])) * xb[32 + l]
            t += d2 * np.float32(_i8(blk[70 + l])) * xb[64 + l] + d3 * np.float32(_i8(blk[104 + l])) * xb[96 + l]
        acc += s + t
    for b in range(4 * quads, n // 32):
        blk = r[off + 34 * b: off + 34 * b + 34]
        xb = x[32 * b: 32 * b + 32]
        s = np.float32(0.0)
        for l in range(32):
            s += np.float32(_i8(blk[2 + l])) * xb[l]
        acc += _f16(blk[0], blk[1]) * s
    return acc


@njit(inline="always")
def _bits_f32(b0, b1, b2, b3, shift):
    """The fp32 whose bits are the little-endian bytes b0..b3, shifted left by `shift`."""
    u = np.uint32(np.uint32(b0) | np.uint32(np.uint32(b1) << np.uint32(8)) | np.uint32(np.uint32(b2) << np.uint32(16))
                  | np.uint32(np.uint32(b3) << np.uint32(24)))
    return np.uint32(u << np.uint32(shift)).view(np.float32)


@njit(fastmath=FASTMATH)
def dot_plain(r, off, x, n, qtype):
    """F32, F16 or BF16 rows (rare in expert tensors: kept simple, not fast)."""
    acc = np.float32(0.0)
    if qtype == BF16:
        for k in range(n):
            acc += _bits_f32(r[off + 2 * k], r[off + 2 * k + 1], 0, 0, 16) * x[k]
    elif qtype == F16:
        for k in range(n):
            acc += _f16(r[off + 2 * k], r[off + 2 * k + 1]) * x[k]
    else:  # F32
        for k in range(n):
            o = off + 4 * k
            acc += _bits_f32(r[o], r[o + 1], r[o + 2], r[o + 3], 0) * x[k]
    return acc


@njit(fastmath=FASTMATH)
def dot_row(r, off, qtype, x):
    """r[off:] as one row of len(x) values of `qtype`, dotted with fp32 x (type checked before)."""
    n = x.shape[0]
    if qtype == Q4_K:
        return dot_q4_k(r, off, x, n)
    if qtype == Q6_K:
        return dot_q6_k(r, off, x, n)
    if qtype == Q8_0:
        return dot_q8_0(r, off, x, n)
    if qtype == Q5_K:
        return dot_q5_k(r, off, x, n)
    return dot_plain(r, off, x, n, qtype)
