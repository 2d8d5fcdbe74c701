"""Dot products of GGML-quantized rows with a float vector, read a machine word at a time: the
inner loop of the quantized slot GEMM (kernels/triton/quant_moe_gemm.py).

Shape legend: R rows, C 64-element chunks, G 32-element groups, B blocks of a pass.

The banks are passed as views of machine words, so each load brings four (Q4_K, Q5_K: int32) or
two (Q6_K, Q8_0: int16) quantized bytes and unpacks them with shifts, instead of one byte per
element; a K-quant block's 144 / 176 bytes are whole int32 words, Q6_K's 210 and Q8_0's 34 bytes
only whole int16 ones. `rows` are word offsets of each row's first block.

The scales are factored out of the sums: for a run of elements sharing a scale s and a min m,
    sum (d*s*q - dmin*m) * x = d*s * sum(q*x) - dmin*m * sum(x),
so the per-element work is an unpack, a conversion and one multiply-add, and the scale fields are
decoded once per run (Q4_K/Q5_K: 32 elements, Q6_K: 16, Q8_0: 32). The sums run in fp32 in a
different order than the dequantize-then-multiply twin's, which the slot GEMM's stated tolerance
covers (kernels/specs/quant.py).

Block layouts (quant_dequant.py's docstring has the values they encode), in words:
  Q4_K: 36 int32: [0] d | dmin << 16, [1:4] the twelve scale/min bytes, [4:36] 128 bytes of 4-bit
        q; byte 32c + l holds element l of sub-block 2c (low nibble) and of 2c + 1 (high nibble).
  Q5_K: 44 int32: as Q4_K with [4:12] the 32 qh bytes (bit j of byte l: the fifth bit of element
        l of sub-block j) before the q words at [12:44].
  Q6_K: 105 int16: [0:64] ql, [64:96] qh, [96:104] 16 int8 scales, [104] d. Element 128n + 32t + l
        (n, t < 4, l < 32) takes its low nibble from ql byte 64n + 32(t % 2) + l (the high nibble
        when t >= 2), its top two bits from bits 2t of qh byte 32n + l, its scale from byte
        8n + 2t + l // 16; value d * scale * (q - 32).
  Q8_0: 17 int16: [0] d, [1:17] 32 int8 q.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

Q8_0, Q4_K, Q5_K, Q6_K = 8, 12, 13, 14
# GGUF type id -> (the word dtype its banks are read in, words per block)
WORDS = {Q8_0: (torch.int16, 17), Q4_K: (torch.int32, 36), Q5_K: (torch.int32, 44), Q6_K: (torch.int16, 105)}
ELEMENTS = {Q8_0: 32, Q4_K: 256, Q5_K: 256, Q6_K: 256}  # per block


@triton.jit
def _low_f16(word):
    """The f16 in the low 16 bits of an integer word, as fp32."""
    return (word & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _small_to_f32(q, offset: tl.constexpr):
    """Integers 0 <= q < 2**23 as fp32 values q - offset, exactly: q's bits under fp32's exponent
    of 2**23 are the float 2**23 + q, from which one subtraction leaves q - offset (exact while
    |q - offset| < 2**24). An OR and an add at full rate, where an int-to-float conversion issues
    at a quarter of it and dominated the unpacking."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)


@triton.jit
def _k_scale_min(w1, w2, w3, sub):
    """Sub-block `sub`'s 6-bit scale and min from a K-quant block's scale words [1:4]: sub-blocks
    0-3 keep them in the low bits of bytes 4+s / 8+s; sub-blocks 4-7 keep their low 4 bits in the
    nibbles of byte 12+s and their top 2 bits in the two high bits of sub-block s = sub - 4's."""
    shift = (sub % 4) * 8
    a = (w1 >> shift) & 0xFF
    b = (w2 >> shift) & 0xFF
    c = (w3 >> shift) & 0xFF
    first = sub < 4
    scale = tl.where(first, a & 0x3F, (c & 0xF) | ((a >> 6) << 4))
    minimum = tl.where(first, b & 0x3F, (c >> 4) | ((b >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def _k_quant_dots(w_ptr, rows, x_ptr, b0, nblk, row_mask, NB: tl.constexpr, FIFTH_BIT: tl.constexpr):
    """Q4_K (FIFTH_BIT False) or Q5_K: the rows' dots over blocks b0 .. b0+NB-1, [R] fp32. A chunk
    is the 64 elements of sub-blocks 2c and 2c+1, whose q share 8 words."""
    BW: tl.constexpr = 44 if FIFTH_BIT else 36
    QS: tl.constexpr = 12 if FIFTH_BIT else 4
    ch = tl.arange(0, NB * 4)  # [C]
    blk = b0 + ch // 4
    c = ch % 4
    c_mask = blk < nblk
    mask = row_mask[:, None] & c_mask[None, :]  # [R, C]
    base = rows[:, None] + blk[None, :].to(tl.int64) * BW  # [R, C] the block's first word
    word = tl.arange(0, 8)[None, None, :, None]  # [1, 1, 8, 1]
    shift = (tl.arange(0, 4) * 8)[None, None, None, :]  # [1, 1, 1, 4] the byte within the word
    q = tl.load(w_ptr + (base + QS + c[None, :] * 8)[:, :, None, None] + word, mask=mask[:, :, None, None],
                other=0)  # [R, C, 8, 1]
    lo = (q >> shift) & 0xF  # [R, C, 8, 4] element 4*word + byte of sub-block 2c
    hi = (q >> (shift + 4)) & 0xF  # ... of sub-block 2c + 1
    if FIFTH_BIT:
        qh = tl.load(w_ptr + (base + 4)[:, :, None, None] + word, mask=mask[:, :, None, None], other=0)
        sub = (c * 2)[None, :, None, None]
        lo |= ((qh >> (shift + sub)) & 1) << 4
        hi |= ((qh >> (shift + sub + 1)) & 1) << 4
    x_offs = ((blk * 256 + c * 64)[:, None, None] + (tl.arange(0, 8) * 4)[None, :, None]
              + tl.arange(0, 4)[None, None, :])  # [C, 8, 4]
    x_mask = c_mask[:, None, None]
    x_lo = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0).to(tl.float32)
    x_hi = tl.load(x_ptr + x_offs + 32, mask=x_mask, other=0.0).to(tl.float32)
    dot_lo = tl.sum(tl.sum(_small_to_f32(lo, 0.0) * x_lo[None, :, :, :], axis=3), axis=2)  # [R, C]
    dot_hi = tl.sum(tl.sum(_small_to_f32(hi, 0.0) * x_hi[None, :, :, :], axis=3), axis=2)
    sum_lo = tl.sum(tl.sum(x_lo, axis=2), axis=1)[None, :]  # [1, C]
    sum_hi = tl.sum(tl.sum(x_hi, axis=2), axis=1)[None, :]
    w0 = tl.load(w_ptr + base, mask=mask, other=0)
    w1 = tl.load(w_ptr + base + 1, mask=mask, other=0)
    w2 = tl.load(w_ptr + base + 2, mask=mask, other=0)
    w3 = tl.load(w_ptr + base + 3, mask=mask, other=0)
    scale_lo, min_lo = _k_scale_min(w1, w2, w3, c[None, :] * 2)
    scale_hi, min_hi = _k_scale_min(w1, w2, w3, c[None, :] * 2 + 1)
    part = (_low_f16(w0) * (scale_lo * dot_lo + scale_hi * dot_hi)
            - _low_f16(w0 >> 16) * (min_lo * sum_lo + min_hi * sum_hi))
    return tl.sum(part, axis=1)


@triton.jit
def _q6_k_dots(w_ptr, rows, x_ptr, b0, nblk, row_mask, NB: tl.constexpr):
    """Q6_K: the rows' dots over blocks b0 .. b0+NB-1, [R] fp32. A group is 32 elements
    (128n + 32t + l), two scales of 16; its ql and qh bytes come two to an int16 word."""
    gg = tl.arange(0, NB * 8)  # [G]
    blk = b0 + gg // 8
    g = gg % 8  # 4n + t
    n = g // 4
    t = g % 4
    g_mask = blk < nblk
    mask = row_mask[:, None] & g_mask[None, :]  # [R, G]
    base = rows[:, None] + blk[None, :].to(tl.int64) * 105  # [R, G]
    pair = tl.arange(0, 16)[None, None, :, None]  # [1, 1, 16, 1] elements 2*pair, 2*pair + 1
    byte = (tl.arange(0, 2) * 8)[None, None, None, :]  # [1, 1, 1, 2]
    m4 = mask[:, :, None, None]
    ql = tl.load(w_ptr + base[:, :, None, None] + (n * 32 + (t % 2) * 16)[None, :, None, None] + pair,
                 mask=m4, other=0).to(tl.int32)  # [R, G, 16, 1]
    qh = tl.load(w_ptr + base[:, :, None, None] + (64 + n * 16)[None, :, None, None] + pair,
                 mask=m4, other=0).to(tl.int32)
    low = (ql >> (byte + ((t // 2) * 4)[None, :, None, None])) & 0xF
    high = (qh >> (byte + (t * 2)[None, :, None, None])) & 0x3
    q = _small_to_f32(low | (high << 4), 32.0)  # [R, G, 16, 2]
    x_offs = ((blk * 256 + g * 32)[:, None, None] + (tl.arange(0, 16) * 2)[None, :, None]
              + tl.arange(0, 2)[None, None, :])  # [G, 16, 2]
    xv = tl.load(x_ptr + x_offs, mask=g_mask[:, None, None], other=0.0).to(tl.float32)
    prod = tl.sum(q * xv[None, :, :, :], axis=3)  # [R, G, 16]
    first = (tl.arange(0, 16) < 8)[None, None, :]
    dot0 = tl.sum(tl.where(first, prod, 0.0), axis=2)  # [R, G] elements l < 16
    dot1 = tl.sum(tl.where(first, 0.0, prod), axis=2)
    scales = tl.load(w_ptr + base + 96 + g[None, :], mask=mask, other=0).to(tl.int32)  # bytes 2g, 2g + 1
    scale0 = ((scales << 24) >> 24).to(tl.float32)  # sign-extended int8s
    scale1 = ((scales << 16) >> 24).to(tl.float32)
    d = tl.load(w_ptr + base + 104, mask=mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.sum(d * (scale0 * dot0 + scale1 * dot1), axis=1)


@triton.jit
def _q8_0_dots(w_ptr, rows, x_ptr, b0, nblk, row_mask, NB: tl.constexpr):
    """Q8_0: the rows' dots over blocks b0 .. b0+NB-1 (32 elements each), [R] fp32."""
    blk = b0 + tl.arange(0, NB)  # [B]
    b_mask = blk < nblk
    mask = row_mask[:, None] & b_mask[None, :]  # [R, B]
    base = rows[:, None] + blk[None, :].to(tl.int64) * 17
    pair = tl.arange(0, 16)[None, None, :, None]
    byte = (tl.arange(0, 2) * 8)[None, None, None, :]
    v = tl.load(w_ptr + base[:, :, None, None] + 1 + pair, mask=mask[:, :, None, None], other=0).to(tl.int32)
    q = _small_to_f32(((v >> byte) & 0xFF) ^ 0x80, 128.0)  # [R, B, 16, 2] the int8s (their bits + 128)
    x_offs = (blk * 32)[:, None, None] + (tl.arange(0, 16) * 2)[None, :, None] + tl.arange(0, 2)[None, None, :]
    xv = tl.load(x_ptr + x_offs, mask=b_mask[:, None, None], other=0.0).to(tl.float32)  # [B, 16, 2]
    dot = tl.sum(tl.sum(q * xv[None, :, :, :], axis=3), axis=2)  # [R, B]
    d = tl.load(w_ptr + base, mask=mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.sum(d * dot, axis=1)


@triton.jit
def block_dots(w_ptr, rows, x_ptr, b0, nblk, row_mask, QTYPE: tl.constexpr, NB: tl.constexpr):
    """sum over blocks b0 .. b0+NB-1 (those < nblk) of each row's block dot with x: [R] fp32.
    w_ptr: the bank as words of `WORDS[QTYPE]`; rows [R] int64 word offsets; x_ptr: the vector
    the rows multiply (element 0 at the row's element 0); masked rows give 0."""
    if QTYPE == 12:
        out = _k_quant_dots(w_ptr, rows, x_ptr, b0, nblk, row_mask, NB, False)
    elif QTYPE == 13:
        out = _k_quant_dots(w_ptr, rows, x_ptr, b0, nblk, row_mask, NB, True)
    elif QTYPE == 14:
        out = _q6_k_dots(w_ptr, rows, x_ptr, b0, nblk, row_mask, NB)
    else:
        out = _q8_0_dots(w_ptr, rows, x_ptr, b0, nblk, row_mask, NB)
    return out


def word_view(name: str, bank: torch.Tensor, qtype: int) -> torch.Tensor:
    """A uint8 bank [S, W] as the words its type's kernel reads; the rows must be whole words."""
    dtype, _ = WORDS[qtype]
    size = dtype.itemsize
    if bank.shape[1] % size or (bank.shape[0] > 1 and bank.stride(0) % size) or bank.data_ptr() % size:
        raise ValueError(f"{name}'s bank rows must start and end on {size}-byte words for its type, "
                         f"got rows of {bank.shape[1]} bytes, {bank.stride(0)} apart")
    return bank.view(dtype)


def blocks_per_pass(qtype: int, elements: int) -> int:
    """Blocks a pass covers for a tile `elements` wide: a power of two, at least one."""
    return max(1, triton.next_power_of_2(max(elements, 1)) // ELEMENTS[qtype])
