"""GGML block dequantization on the device: `dequantize_rows`, the kernel that turns a streamed
layer's quantized experts into bf16 banks for the grouped prefill GEMM, over one `@triton.jit`
group function. (The decode slot GEMM reads the same blocks without writing them out:
kernels/triton/quant_row_dots.py.)

Shape legend: R rows, n elements per row (the row is along the input dimension, GGUF ne0).

Formats (GGUF type ids; a row of n elements is n / elements-per-block consecutive blocks):
  Q8_0 (8):  32 elements in 34 bytes: f16 d, 32 int8 q;                value = d * q.
  Q4_K (12): 256 elements in 144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scale/min pairs for
             eight sub-blocks of 32, 128 bytes of 4-bit q (a byte holds element l of sub-block
             2c in its low nibble and element l of sub-block 2c+1 in its high one);
             value = (d * scale) * q - dmin * min.
  Q5_K (13): 256 in 176: as Q4_K, with 32 bytes qh before q: bit j of qh[l] is the fifth bit of
             element l of sub-block j.
  Q6_K (14): 256 in 210: 128 bytes low nibbles, 64 bytes high bit pairs, 16 int8 scales (one per
             16 elements), f16 d; value = (d * scale) * (q - 32).
The products are formed in the order written above, in fp32, which is the order of the reference
(`gguf.quants.dequantize`): every product but Q6_K's last is exact in fp32, and that one is a
single rounding, so the dequantized values equal the reference's bit for bit.

Twin: `gguf.quants.dequantize` followed by torch's cast to the output dtype, bit for bit except
NaN payloads (the "dequantize_rows" pair in kernels/specs/quant.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton.rounding import store_rounded
from freetoken.quant.ggml_blocks import BLOCK_SIZES

Q8_0, Q4_K, Q5_K, Q6_K = 8, 12, 13, 14
# GGUF type id -> (elements per block, bytes per block), the types these kernels read
BLOCKS = {int(t): size for t, size in BLOCK_SIZES.items() if int(t) in (Q8_0, Q4_K, Q5_K, Q6_K)}
TYPE_NAMES = {Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}

BLOCK_E = 1024  # elements one program of `dequantize_rows` writes


def row_bytes(qtype: int, n: int) -> int:
    """Bytes of one row of n elements of `qtype`; n must be a whole number of blocks."""
    if qtype not in BLOCKS:
        raise ValueError(f"quantized type {qtype} is not one of the device kernels' "
                         f"{', '.join(f'{v} ({k})' for k, v in TYPE_NAMES.items())}")
    elements, nbytes = BLOCKS[qtype]
    if n <= 0 or n % elements:
        raise ValueError(f"a {TYPE_NAMES[qtype]} row holds whole blocks of {elements} elements, not {n}")
    return n // elements * nbytes


@triton.jit
def _f16(ptr, mask):
    """The little-endian f16 at ptr (two bytes, any alignment) as fp32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


# Elements per group: the run of a block that shares one scale (and min). Kernels tile a row as
# [groups, GROUP] so that the per-group fields (d, dmin, the packed scales) are loaded once per
# group, not once per element, and the quantized bytes of a group are one contiguous run.
GROUP = {Q8_0: 32, Q4_K: 32, Q5_K: 32, Q6_K: 16}


@triton.jit
def _k_quant_groups(rows, g, lane, mask, BYTES: tl.constexpr, QS: tl.constexpr, FIFTH_BIT: tl.constexpr):
    """Q4_K (BYTES 144, 4-bit values at QS 16) or Q5_K (176, at 48, the fifth bits at 16): groups
    are the eight sub-blocks of 32 of each 256-element block."""
    block = rows + (g // 8) * BYTES
    sub = g % 8
    # Sub-blocks 0-3 keep their 6-bit scale/min in the low bits of bytes 4+s / 8+s; sub-blocks 4-7
    # keep their low 4 bits in the nibbles of byte 12+s and their top 2 bits in the two high bits
    # of the bytes that hold sub-block s = sub - 4.
    a = tl.load(block + 4 + sub % 4, mask=mask, other=0).to(tl.int32)
    b = tl.load(block + 8 + sub % 4, mask=mask, other=0).to(tl.int32)
    c = tl.load(block + 12 + sub % 4, mask=mask, other=0).to(tl.int32)
    first = sub < 4
    scale = tl.where(first, a & 0x3F, (c & 0xF) | ((a >> 6) << 4)).to(tl.float32)
    minimum = tl.where(first, b & 0x3F, (c >> 4) | ((b >> 6) << 4)).to(tl.float32)
    # a byte holds element l of sub-block 2c in its low nibble and of 2c+1 in its high one
    q = tl.load(block + QS + (sub // 2) * 32 + lane, mask=mask, other=0).to(tl.int32)
    q = (q >> ((sub % 2) * 4)) & 0xF
    if FIFTH_BIT:
        fifth = tl.load(block + 16 + lane, mask=mask, other=0).to(tl.int32)
        q = q | (((fifth >> sub) & 1) << 4)
    return (_f16(block, mask) * scale) * q.to(tl.float32) - _f16(block + 2, mask) * minimum


@triton.jit
def dequant_groups(rows, g, lane, mask, QTYPE: tl.constexpr):
    """fp32 values of element `lane` of group `g` of the rows starting at `rows` (uint8 pointers),
    broadcast against each other as rows [R, 1, 1], g [1, U, 1], lane [1, 1, GROUP]; mask [R, U, 1]
    (masked-off groups read nothing and are 0). Element g * GROUP + lane of a row."""
    if QTYPE == 8:  # Q8_0: a group is a block
        block = rows + g * 34
        q = tl.load(block + 2 + lane, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        values = q * _f16(block, mask)
    elif QTYPE == 12:
        values = _k_quant_groups(rows, g, lane, mask, 144, 16, False)
    elif QTYPE == 13:
        values = _k_quant_groups(rows, g, lane, mask, 176, 48, True)
    else:  # Q6_K (14): groups of 16, one int8 scale each
        block = rows + (g // 16) * 210
        sub = g % 16
        half = sub // 8  # which 128 elements
        quarter = (sub % 8) // 2  # which nibble / bit pair of the bytes below
        lane32 = (sub % 2) * 16 + lane
        low = tl.load(block + half * 64 + (quarter % 2) * 32 + lane32, mask=mask, other=0).to(tl.int32)
        high = tl.load(block + 128 + half * 32 + lane32, mask=mask, other=0).to(tl.int32)
        low = (low >> ((quarter // 2) * 4)) & 0xF
        high = (high >> (2 * quarter)) & 0x3
        q = ((low | (high << 4)) - 32).to(tl.float32)
        scale = tl.load(block + 192 + sub, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        values = (_f16(block + 208, mask) * scale) * q
    return values


@triton.jit
def _dequant_rows_kernel(src_ptr, out_ptr, n, src_stride, QTYPE: tl.constexpr, G: tl.constexpr,
                         BLOCK: tl.constexpr, OUT_BF16: tl.constexpr):
    row = tl.program_id(0)
    g = (tl.program_id(1) * (BLOCK // G) + tl.arange(0, BLOCK // G))[None, :, None]  # [1, U, 1]
    lane = tl.arange(0, G)[None, None, :]  # [1, 1, G]
    mask = g * G < n
    values = dequant_groups(src_ptr + row.to(tl.int64) * src_stride, g, lane, mask, QTYPE)  # [1, U, G]
    e = g * G + lane
    store_rounded(out_ptr + row.to(tl.int64) * n + e, values, mask & (lane >= 0), OUT_BF16)


def dequantize_rows(src: torch.Tensor, qtype: int, n: int, dtype: torch.dtype = torch.bfloat16,
                    block: int = BLOCK_E) -> torch.Tensor:
    """src uint8 [R, >= row_bytes(qtype, n)] (rows may be padded or strided; bytes within a row
    contiguous) -> [R, n] in `dtype` (bf16, fp16 or fp32), rounded to nearest even once from fp32.
    block: elements per program (a power of two)."""
    nbytes = row_bytes(qtype, n)
    if src.dtype != torch.uint8 or src.dim() != 2 or src.shape[1] < nbytes or (src.shape[1] > 1 and src.stride(1) != 1):
        raise ValueError(f"src must be uint8 [R, >= {nbytes}] with contiguous rows for {n} "
                         f"{TYPE_NAMES[qtype]} elements, got {src.dtype}{tuple(src.shape)}")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dequantize_rows writes bf16, fp16 or fp32, not {dtype}")
    out = torch.empty((src.shape[0], n), dtype=dtype, device=src.device)  # [R, n]
    if src.shape[0]:
        bl = max(min(block, triton.next_power_of_2(n)), GROUP[qtype])
        _dequant_rows_kernel[(src.shape[0], triton.cdiv(n, bl))](
            src, out, n, src.stride(0), QTYPE=qtype, G=GROUP[qtype], BLOCK=bl, OUT_BF16=dtype == torch.bfloat16)
    return out
