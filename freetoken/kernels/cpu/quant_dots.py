"""Dot products of one GGUF-quantized row with an int16-quantized vector, in integers (Numba).

A row is consecutive blocks of its type (Q8_0: 32 values in 34 bytes, f16 d then int8 q, value
d*q; Q4_K/Q5_K: 256 values as 8 sub-blocks of 32, each with a 6-bit scale and min, value
d*sc*q - dmin*m; Q6_K: 256 values as 16 sub-blocks of 16, int8 scale, value d*sc*(q - 32);
F32/F16/BF16: plain values). No dequantized row is ever written.

The vector is quantized once (`quantize_vector`) per chunk of 32 values: xq int16 codes, xd the
chunk's fp32 step (max|x| / CODE_MAX, so x ~ xd * xq to within xd / 2), xs the chunk's sum of
codes. Why int16 and not int8: the weight codes are widened to 16 bits for the multiply-add
(16 x 16 -> 32-bit pairs) anyway, so 16-bit activation codes cost the same instructions and
make the activation's rounding 256 times smaller (int8 codes moved a small model's logits
enough to flip near-tied greedy tokens). Every integer sum stays far inside int32 (at most
32 * 128 * 32767 per sub-block); the scale and min products are taken in fp32.
A weight sub-block inside one chunk then dots in integers, sum(q * xq) in int32, and takes its
float scales once: Q8_0 d * xd * sum; Q4_K/Q5_K (d * sc * sum(q * xq) - dmin * m * xs) * xd;
Q6_K d * sc * sum((q - 32) * xq) * xd (two 16-value sub-blocks share a chunk). Plain rows dot
the fp32 vector itself.

The expert kernels run these dots in explicit SIMD vectors (`vector_dots.py`: the same integer
sums, the scale products in another order); the scalar dots here are their twins and the fallback
for rows that are not contiguous bytes.

Why the loops look the way they do (all of it is for LLVM's vectoriser, which gets partway):
  - one loop per block (per half block for Q6_K) whose lane l touches every sub-block's l-th
    value, one int32 accumulator per sub-block, so each sub-block's sums stay in vector lanes
    and are reduced once a block;
  - codes are widened to int32 before multiplying and every product and sum is truncated back
    to int32 (Numba widens integer arithmetic to int64; the truncation lets LLVM keep 32-bit
    lanes);
  - a block is a slice of the row and the loop index a constant range, so every index is known
    non-negative and Numba's negative-index wraparound folds away (loads stay contiguous).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from freetoken.kernels.cpu.experts import FASTMATH

# GGUF type ids of the formats read here.
F32, F16, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 8, 12, 13, 14, 30

_M2, _M3, _M15 = np.int32(1), np.int32(3), np.int32(15)
CODE_MAX = 32767  # the largest activation code (int16)


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
def _i32(v):
    return np.int32(v)


@njit(inline="always")
def _k4_scale_min(s, o, j):
    """Sub-block j's 6-bit (scale, min) from the 12 packed pairs at s[o:o + 12]."""
    if j < 4:
        return np.int32(s[o + j] & 63), np.int32(s[o + j + 4] & 63)
    sc = np.int32((s[o + j + 4] & 15) | ((s[o + j - 4] >> 6) << 4))
    m = np.int32((s[o + j + 4] >> 4) | ((s[o + j] >> 6) << 4))
    return sc, m


@njit(fastmath=FASTMATH, inline="always")
def _k4_term(blk, j, s, xd, xs, c0):
    """Sub-block j's (scale part, min part) from its integer sum s; x chunk c0 + j."""
    sc, m = _k4_scale_min(blk, 4, j)
    step = xd[c0 + j]
    return np.float32(sc) * np.float32(s) * step, np.float32(m) * np.float32(xs[c0 + j]) * step


@njit(fastmath=FASTMATH, inline="always")
def _k4_combine(blk, s0, s1, s2, s3, s4, s5, s6, s7, xd, xs, c0):
    """A Q4_K/Q5_K block's value from its 8 sub-blocks' integer sums; its x chunks start at c0."""
    a0, m0 = _k4_term(blk, 0, s0, xd, xs, c0)
    a1, m1 = _k4_term(blk, 1, s1, xd, xs, c0)
    a2, m2 = _k4_term(blk, 2, s2, xd, xs, c0)
    a3, m3 = _k4_term(blk, 3, s3, xd, xs, c0)
    a4, m4 = _k4_term(blk, 4, s4, xd, xs, c0)
    a5, m5 = _k4_term(blk, 5, s5, xd, xs, c0)
    a6, m6 = _k4_term(blk, 6, s6, xd, xs, c0)
    a7, m7 = _k4_term(blk, 7, s7, xd, xs, c0)
    return (_f16(blk[0], blk[1]) * ((a0 + a1) + (a2 + a3) + (a4 + a5) + (a6 + a7))
            - _f16(blk[2], blk[3]) * ((m0 + m1) + (m2 + m3) + (m4 + m5) + (m6 + m7)))


@njit(fastmath=FASTMATH)
def dot_q4_k(r, off, xq, xd, xs, n):
    """Q4_K: byte l of 32-byte chunk c holds value 64c + l (low nibble, sub-block 2c) and
    64c + 32 + l (high nibble, sub-block 2c + 1)."""
    acc = np.float32(0.0)
    for b in range(n // 256):
        blk = r[off + 144 * b: off + 144 * b + 144]
        q = xq[256 * b: 256 * b + 256]
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.int32(0)
        for l in range(32):
            v0, v1, v2, v3 = _i32(blk[16 + l]), _i32(blk[48 + l]), _i32(blk[80 + l]), _i32(blk[112 + l])
            s0 = _i32(s0 + _i32(_nib_lo(v0) * _i32(q[l])))
            s1 = _i32(s1 + _i32(_nib_hi(v0) * _i32(q[32 + l])))
            s2 = _i32(s2 + _i32(_nib_lo(v1) * _i32(q[64 + l])))
            s3 = _i32(s3 + _i32(_nib_hi(v1) * _i32(q[96 + l])))
            s4 = _i32(s4 + _i32(_nib_lo(v2) * _i32(q[128 + l])))
            s5 = _i32(s5 + _i32(_nib_hi(v2) * _i32(q[160 + l])))
            s6 = _i32(s6 + _i32(_nib_lo(v3) * _i32(q[192 + l])))
            s7 = _i32(s7 + _i32(_nib_hi(v3) * _i32(q[224 + l])))
        acc += _k4_combine(blk, s0, s1, s2, s3, s4, s5, s6, s7, xd, xs, 8 * b)
    return acc


@njit(inline="always")
def _q5(nib, h, j):
    """A Q5_K code 0..31: its nibble plus bit j of h as 16."""
    return _i32(nib | _i32(_i32(_i32(h >> np.int32(j)) & _M2) << np.int32(4)))


@njit(fastmath=FASTMATH)
def dot_q5_k(r, off, xq, xd, xs, n):
    """Q5_K: Q4_K's nibbles plus a fifth bit, bit j of qh[l] for sub-block j's value l."""
    acc = np.float32(0.0)
    for b in range(n // 256):
        blk = r[off + 176 * b: off + 176 * b + 176]
        q = xq[256 * b: 256 * b + 256]
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.int32(0)
        for l in range(32):
            h = _i32(blk[16 + l])
            v0, v1, v2, v3 = _i32(blk[48 + l]), _i32(blk[80 + l]), _i32(blk[112 + l]), _i32(blk[144 + l])
            s0 = _i32(s0 + _i32(_q5(_nib_lo(v0), h, 0) * _i32(q[l])))
            s1 = _i32(s1 + _i32(_q5(_nib_hi(v0), h, 1) * _i32(q[32 + l])))
            s2 = _i32(s2 + _i32(_q5(_nib_lo(v1), h, 2) * _i32(q[64 + l])))
            s3 = _i32(s3 + _i32(_q5(_nib_hi(v1), h, 3) * _i32(q[96 + l])))
            s4 = _i32(s4 + _i32(_q5(_nib_lo(v2), h, 4) * _i32(q[128 + l])))
            s5 = _i32(s5 + _i32(_q5(_nib_hi(v2), h, 5) * _i32(q[160 + l])))
            s6 = _i32(s6 + _i32(_q5(_nib_lo(v3), h, 6) * _i32(q[192 + l])))
            s7 = _i32(s7 + _i32(_q5(_nib_hi(v3), h, 7) * _i32(q[224 + l])))
        acc += _k4_combine(blk, s0, s1, s2, s3, s4, s5, s6, s7, xd, xs, 8 * b)
    return acc


@njit(inline="always")
def _q6(low, h, j):
    """A Q6_K code minus its offset, -32..31, from its 4 low bits and bits 2j, 2j+1 of h."""
    return _i32(_i32(low | _i32(_i32(_i32(h >> np.int32(2 * j)) & _M3) << np.int32(4))) - np.int32(32))


@njit(fastmath=FASTMATH)
def dot_q6_k(r, off, xq, xd, xs, n):
    """Q6_K: each half block (128 values) is ql[64], qh[32] and 8 int8 scales; lane l of the
    loop takes values l and l + 16 of each of the half's four runs of 32 (one x chunk each)."""
    acc = np.float32(0.0)
    for b in range(n // 256):
        blk = r[off + 210 * b: off + 210 * b + 210]
        d = _f16(blk[208], blk[209])
        for half in range(2):
            ql = blk[64 * half: 64 * half + 64]
            qh = blk[128 + 32 * half: 160 + 32 * half]
            sc = blk[192 + 8 * half: 200 + 8 * half]
            q = xq[256 * b + 128 * half: 256 * b + 128 * half + 128]
            s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.int32(0)
            for l in range(16):
                a, a2 = _i32(ql[l]), _i32(ql[l + 16])
                e, e2 = _i32(ql[l + 32]), _i32(ql[l + 48])
                h, h2 = _i32(qh[l]), _i32(qh[l + 16])
                s0 = _i32(s0 + _i32(_q6(_nib_lo(a), h, 0) * _i32(q[l])))
                s1 = _i32(s1 + _i32(_q6(_nib_lo(a2), h2, 0) * _i32(q[l + 16])))
                s2 = _i32(s2 + _i32(_q6(_nib_lo(e), h, 1) * _i32(q[l + 32])))
                s3 = _i32(s3 + _i32(_q6(_nib_lo(e2), h2, 1) * _i32(q[l + 48])))
                s4 = _i32(s4 + _i32(_q6(_nib_hi(a), h, 2) * _i32(q[l + 64])))
                s5 = _i32(s5 + _i32(_q6(_nib_hi(a2), h2, 2) * _i32(q[l + 80])))
                s6 = _i32(s6 + _i32(_q6(_nib_hi(e), h, 3) * _i32(q[l + 96])))
                s7 = _i32(s7 + _i32(_q6(_nib_hi(e2), h2, 3) * _i32(q[l + 112])))
            c0 = 8 * b + 4 * half
            p0 = np.float32(_i8(sc[0])) * np.float32(s0) + np.float32(_i8(sc[1])) * np.float32(s1)
            p1 = np.float32(_i8(sc[2])) * np.float32(s2) + np.float32(_i8(sc[3])) * np.float32(s3)
            p2 = np.float32(_i8(sc[4])) * np.float32(s4) + np.float32(_i8(sc[5])) * np.float32(s5)
            p3 = np.float32(_i8(sc[6])) * np.float32(s6) + np.float32(_i8(sc[7])) * np.float32(s7)
            acc += d * (p0 * xd[c0] + p1 * xd[c0 + 1] + p2 * xd[c0 + 2] + p3 * xd[c0 + 3])
    return acc


@njit(fastmath=FASTMATH)
def dot_q8_0(r, off, xq, xd, n):
    """Q8_0, four blocks a loop (a loop body of one block's 32 products is unrolled whole and
    left scalar), then single blocks for the rest of the row; one x chunk per block."""
    acc = np.float32(0.0)
    quads = n // 128
    for b in range(quads):
        blk = r[off + 136 * b: off + 136 * b + 136]
        q = xq[128 * b: 128 * b + 128]
        s0 = s1 = s2 = s3 = np.int32(0)
        for l in range(32):
            s0 = _i32(s0 + _i32(_i8(blk[2 + l]) * _i32(q[l])))
            s1 = _i32(s1 + _i32(_i8(blk[36 + l]) * _i32(q[32 + l])))
            s2 = _i32(s2 + _i32(_i8(blk[70 + l]) * _i32(q[64 + l])))
            s3 = _i32(s3 + _i32(_i8(blk[104 + l]) * _i32(q[96 + l])))
        c = 4 * b
        acc += (_f16(blk[0], blk[1]) * xd[c] * np.float32(s0) + _f16(blk[34], blk[35]) * xd[c + 1] * np.float32(s1)
                + _f16(blk[68], blk[69]) * xd[c + 2] * np.float32(s2)
                + _f16(blk[102], blk[103]) * xd[c + 3] * np.float32(s3))
    for b in range(4 * quads, n // 32):
        blk = r[off + 34 * b: off + 34 * b + 34]
        q = xq[32 * b: 32 * b + 32]
        s = np.int32(0)
        for l in range(32):
            s = _i32(s + _i32(_i8(blk[2 + l]) * _i32(q[l])))
        acc += _f16(blk[0], blk[1]) * xd[b] * np.float32(s)
    return acc


@njit(fastmath=FASTMATH)
def quantize_vector(x, xq, xd, xs):
    """xq[:], xd[c], xs[c] = x's int16 codes, each chunk c of 32 values' step max|x| / CODE_MAX and its
    sum of codes (module docstring); len(x) a multiple of 32. Round to nearest, so
    |x - xd * xq| <= xd / 2 (an all-zero chunk has step 0 and codes 0)."""
    for c in range(x.shape[0] // 32):
        v = x[32 * c: 32 * c + 32]
        amax = np.float32(0.0)
        for l in range(32):
            amax = max(amax, abs(v[l]))
        step = amax / np.float32(CODE_MAX)
        inv = np.float32(CODE_MAX) / amax if amax > np.float32(0.0) else np.float32(0.0)
        s = np.int32(0)
        for l in range(32):
            k = np.int32(np.rint(v[l] * inv))
            xq[32 * c + l] = np.int16(k)
            s = _i32(s + k)
        xd[c] = step
        xs[c] = s

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
def dot_row(r, off, qtype, x, xq, xd, xs):
    """r[off:] as one row of len(x) values of `qtype` (type checked before): quantized types dot
    the vector's codes (xq, xd, xs from `quantize_vector`), plain types the fp32 x itself."""
    n = x.shape[0]
    if qtype == Q4_K:
        return dot_q4_k(r, off, xq, xd, xs, n)
    if qtype == Q6_K:
        return dot_q6_k(r, off, xq, xd, xs, n)
    if qtype == Q8_0:
        return dot_q8_0(r, off, xq, xd, n)
    if qtype == Q5_K:
        return dot_q5_k(r, off, xq, xd, xs, n)
    return dot_plain(r, off, x, n, qtype)
