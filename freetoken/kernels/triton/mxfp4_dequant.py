"""MXFP4 blocks dequantized on the device in one pass: `dequantize_mxfp4_triton`, the device twin
of quant/mxfp4.py's `dequantize_mxfp4` (same contract, same bits). Long prefill chunks of gpt-oss
dequantize their routed slots a group at a time for grouped GEMMs (moe/mxfp4_format.py); the
torch ops there move ~40 bytes a weight through temporaries, this kernel reads the 0.5 byte of
codes and 1/32 scale byte a weight and writes each value once.

Shape legend: O outer rows (the leading dimension, which may be strided: a slot's byte row in a
bank), B groups of 32 values in an outer row (all the other dimensions, contiguous).

Codes are read as int32 words, four per block: word j of a block holds elements 8j .. 8j + 7 in
its nibbles, low nibble first (the checkpoint's even/odd pairs in little-endian bytes), so a
program's output is a [groups, 4, 8] tile contiguous along its last two dimensions.

Numerics: the reference computes lut[code] * 2**(e - 127) in fp32 (ldexp is a multiply by pow(2,
e - 127)), then casts. Here the same product of the same two fp32 numbers, so every case agrees
by construction, the edges included: e = 0's factor is the subnormal 2**-127 and its products
are exact subnormals; e = 255's factor is +inf, so nonzero codes give +-inf and the two zero codes
NaN (0 * inf); a finite product past fp32's range is +-inf; -0 stays -0. The code's value is
built without a table: its magnitude bits (c & 7) << 22 are, as fp32, the code's value times
2**-126 (E2M1 sits in fp32's subnormal range, exponent and mantissa in place), so one exact
multiply by 2**126 gives it. Both multiplies need subnormals kept: Triton's fp32 multiply does
(only libdevice calls flush them). The cast: bf16 holds every finite value exactly (at most two
significant bits, down to 2**-133), so any rounding gives the same bits, the interpreter's
truncating cast included; fp16 is rounded to nearest even (the device's cvt.rn, numpy's cast in
the interpreter), as torch's `.to(torch.float16)` rounds, subnormals and overflow to inf included.
NaN payloads may differ from the reference's.

Twin: `dequantize_mxfp4` (the "mxfp4_dequant" pair, kernels/specs/mxfp4.py), bit for
bit but NaN payloads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.quant.mxfp4 import BLOCK, BLOCK_BYTES

# Groups (32 values, 16 code bytes) one program writes: 2 KB of codes in, 8 KB of bf16 out, one
# group per thread at 4 warps.
BLOCK_GROUPS = 128
WARPS = 4
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _mxfp4_dequant_kernel(words_ptr, scales_ptr, out_ptr, picked_ptr, groups, chunks, words_stride, scales_stride,
                          BLOCK_G: tl.constexpr, OUT_BF16: tl.constexpr, PICKED: tl.constexpr):
    pid = tl.program_id(0)
    row = (pid // chunks).to(tl.int64)  # the output's outer row
    if PICKED:  # the input's outer row
        src = tl.load(picked_ptr + row)
    else:
        src = row
    g0 = (pid % chunks).to(tl.int64) * BLOCK_G
    g = tl.arange(0, BLOCK_G)  # [BG]
    mask = g < groups - g0
    word = g[:, None, None] * 4 + tl.arange(0, 4)[None, :, None]  # [BG, 4, 1]
    q = tl.load(words_ptr + src * words_stride + g0 * 4 + word, mask=mask[:, None, None], other=0)
    e = tl.load(scales_ptr + src * scales_stride + g0 + g, mask=mask, other=0).to(tl.int32)
    # 2**(e - 127) as fp32 bits: e << 23, but e = 0 is the subnormal 2**-127 (e = 255 is +inf)
    scale = tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)[:, None, None]
    c = q >> (tl.arange(0, 8) * 4)[None, None, :]  # [BG, 4, 8] element 8 * word + nibble in the low 4 bits
    bits = ((c & 7) << 22) | ((c & 8) << 28)
    values = (bits.to(tl.float32, bitcast=True) * 2.0**126) * scale
    offs = g[:, None, None] * 32 + tl.arange(0, 4)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    out = out_ptr + row * groups * 32 + g0 * 32  # 32 values a group (BLOCK)
    mask = mask[:, None, None] & (offs >= 0)
    if OUT_BF16:  # exact in bf16 (the low 16 bits are 0): its bits are the top half, subnormals too
        top = (values.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16)
        tl.store(out + offs, top.to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(out + offs, values.to(out_ptr.dtype.element_ty), mask=mask)


def _outer_rows(t: torch.Tensor, outer: int) -> torch.Tensor:
    """t -> [outer, rest] with the rest contiguous, a view where t allows one (a copy otherwise)."""
    rows = t.reshape(outer, -1)
    return rows if rows.shape[1] <= 1 or rows.stride(1) == 1 else rows.contiguous()


def dequantize_mxfp4_triton(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
                            block_groups: int = BLOCK_GROUPS, warps: int = WARPS,
                            picked: torch.Tensor | None = None) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G*32] in `dtype` (bf16, fp16 or
    fp32), equal to `dequantize_mxfp4(blocks, scales, dtype)` bit for bit but NaN payloads.
    The leading dimension may be strided (slots' rows of a bank); the others are read as one
    contiguous run (a copy is made where they are not, or where the codes are not 4-byte aligned).
    picked: int64 [P] indices into the leading dimension, on the blocks' device: the result is
    `dequantize_mxfp4(blocks[picked], scales[picked])` [P, ..., G*32], read in place (a prefill
    group's slots, without gathering their code bytes first). Indices are not range-checked on
    the device: the caller's slots are. block_groups: groups per program, a power of two."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_BYTES or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected blocks [..., G, {BLOCK_BYTES}] and scales [..., G])")
    if dtype not in OUT_DTYPES:
        raise ValueError(f"dequantize_mxfp4_triton writes bf16, fp16 or fp32, not {dtype}")
    if blocks.device != scales.device:
        raise ValueError(f"MXFP4 blocks on {blocks.device}, scales on {scales.device}")
    lead = scales.shape[:-1]
    if picked is not None:
        if blocks.dim() < 3 or picked.dim() != 1 or picked.dtype != torch.int64 or picked.device != blocks.device:
            raise ValueError("picked indexes the leading dimension of blocks [O, ..., G, 16]: int64 [P] on "
                             f"{blocks.device}, got {picked.dtype} {tuple(picked.shape)} on {picked.device}")
        lead = (picked.shape[0], *lead[1:])
    out = torch.empty((*lead, scales.shape[-1] * BLOCK), dtype=dtype, device=blocks.device)
    if out.numel() == 0:
        return out
    # one run where the blocks are one (no part-filled program at each row's end), else per leading index
    outer = blocks.shape[0] if picked is not None or (blocks.dim() > 2 and not blocks.is_contiguous()) else 1
    codes = _outer_rows(blocks, outer)  # [O, B * 16]
    if codes.storage_offset() % 4 or (outer > 1 and codes.stride(0) % 4):
        codes = codes.clone(memory_format=torch.contiguous_format)  # the words must be aligned
    words = codes.view(torch.int32)  # [O, B * 4]
    exps = _outer_rows(scales, outer)  # [O, B]
    groups = exps.shape[1]
    chunks = triton.cdiv(groups, block_groups)
    programs = (picked.shape[0] if picked is not None else outer) * chunks
    _mxfp4_dequant_kernel[(programs,)](words, exps, out, words if picked is None else picked, groups, chunks,
                                       words.stride(0), exps.stride(0), BLOCK_G=block_groups,
                                       OUT_BF16=dtype == torch.bfloat16, PICKED=picked is not None,
                                       num_warps=warps)
    return out
