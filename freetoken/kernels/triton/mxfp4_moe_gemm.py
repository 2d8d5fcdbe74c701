"""Fused MoE GEMM over cache slots holding gpt-oss's MXFP4 experts (decode-oriented: N is a
handful of tokens): biased projections and the clamped SwiGLU, the weights decoded inside the
kernels from the blocks the checkpoint stores (quant/mxfp4.py).

Shape legend: N tokens, K top-k, H hidden, I expert intermediate, S slots, G = columns / 32.

A slot's banks are flat byte rows, each a projection's tensors as the checkpoint has them
(moe/mxfp4_format.py lays them out; the offsets are recomputed here, kernels being below moe):
  w13 [S, >= W13]: gate_up blocks [2I, G_H, 16], scales [2I, G_H], bias [2I]; row 2i is gate i,
                   row 2i + 1 up i (interleaved, as stored)
  w2  [S, >= W2]:  down blocks [H, G_I, 16], scales [H, G_I], bias [H]
The biases are bf16 or fp32 (a compile-time constant). Each bank is read as int32 words: a block's
32 codes are 4 words, word j holding elements 8j .. 8j + 7 in its nibbles, low nibble first; the
scale bytes and the biases are picked out of their words with shifts (little-endian words).

Numerics. An E2M1 code c becomes its fp32 value by its bits, no table: with m = c & 7, the
normal codes (m >= 2: exponent field e = m >> 1, mantissa bit m & 1) are (m << 22) + (126 << 23),
m = 1 (0.5) is 126 << 23 and m = 0 is 0; the sign bit 3 moves to bit 31. Each block's dot with
the input sums 32 products in fp32 and is multiplied once by 2**(e - 127), built exactly as fp32
bits e << 23 (e = 0: the subnormal 2**-127, 0x00400000; a device that flushes subnormals would
drop those blocks, whose weights are all below 2**-124). e = 255, the MX spec's NaN, gives +inf
(bits 0x7F800000), as the CPU kernel (kernels/cpu/mxfp4_experts.py) does: the block's dot times
inf is +-inf, or NaN where the dot is 0; `dequantize_mxfp4`'s ldexp makes only codes of magnitude
>= 1 infinite there, so the two agree on finite scales only (real checkpoints hold none of 255).
Every other scale matches `dequantize_mxfp4` exactly per weight; only the sums' order differs.

Twin: kernels/specs/mxfp4.py ("mxfp4_slots_gemm"): `dequantize_mxfp4` of the banks, then
`reference.moe.clamped_swiglu_expert` per route in fp32 and one rounding at the end; tolerance
stated there. The same two deterministic kernels as quant_moe_gemm.py, with its rounding points:
  1. act [N*K, I] fp32 (not rounded): clamped_swiglu(x @ gate.T + b_gate, x @ up.T + b_up) per
     routed (token, k), grid over (route, I blocks), looping over H's blocks; a route of -1
     gives zeros and reads no weights.
  2. out [N, H]: sum over k in order 0..K-1 of weight * (act @ down.T + b_down), grid over
     (token, H blocks), looping over k and I's blocks; rounded once to x's dtype.
The tiles and warps below are placeholders: this kernel has not been measured on a GPU yet (the
engine's `--moe-gemm auto` keeps the dequantizing torch loop for these experts). Plain launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton.rounding import store_rounded
from freetoken.quant.mxfp4 import BLOCK, BLOCK_BYTES

# (BLOCK_I, BLOCK_H) of _mxfp4_act_kernel: act outputs per program (each a gate and an up row),
# elements of a pass along H; (BLOCK_H, BLOCK_I) of _mxfp4_down_kernel; each kernel's num_warps.
# Not tuned (no GPU measurement yet).
ACT_BLOCKS = (8, 512)
DOWN_BLOCKS = (8, 512)
WARPS = (4, 4)
BIAS_DTYPES = (torch.bfloat16, torch.float32)


@triton.jit
def _mxfp4_dots(w_ptr, code_rows, scale_rows, x_ptr, b0, nblk, row_mask, NB: tl.constexpr):
    """sum over blocks b0 .. b0+NB-1 (those < nblk) of each row's scaled block dot with x: [R] fp32.
    w_ptr: the slot's words (int32); code_rows [R]: word offsets of each row's first block;
    scale_rows [R]: byte offsets of each row's first scale; masked rows give 0."""
    blk = b0 + tl.arange(0, NB)  # [B]
    b_mask = blk < nblk
    mask = row_mask[:, None] & b_mask[None, :]  # [R, B]
    word = tl.arange(0, 4)[None, None, :, None]  # [1, 1, 4, 1]
    shift = (tl.arange(0, 8) * 4)[None, None, None, :]  # [1, 1, 1, 8] the nibble within the word
    q = tl.load(w_ptr + (code_rows[:, None] + blk[None, :] * 4)[:, :, None, None] + word,
                mask=mask[:, :, None, None], other=0)  # [R, B, 4, 1]
    c = q >> shift  # [R, B, 4, 8] element 8 * word + nibble in the low 4 bits
    m = c & 7
    bits = tl.where(m >= 2, (m << 22) + 0x3F000000, (m & 1) * 0x3F000000) | ((c & 8) << 28)
    v = bits.to(tl.float32, bitcast=True)
    x_offs = ((blk * 32)[:, None, None] + (tl.arange(0, 4) * 8)[None, :, None]
              + tl.arange(0, 8)[None, None, :])  # [B, 4, 8]
    xv = tl.load(x_ptr + x_offs, mask=b_mask[:, None, None], other=0.0).to(tl.float32)
    dot = tl.sum(tl.sum(v * xv[None, :, :, :], axis=3), axis=2)  # [R, B]
    byte = scale_rows[:, None] + blk[None, :]  # [R, B]
    e = (tl.load(w_ptr + (byte >> 2), mask=mask, other=0) >> ((byte & 3) * 8)) & 0xFF
    scale = tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)  # 2**(e - 127)
    return tl.sum(dot * scale, axis=1)


@triton.jit
def _mxfp4_bias(w_ptr, bias_word, rows, mask, BIAS_BF16: tl.constexpr):
    """Biases of `rows` [R] as fp32, from the slot's words starting at word `bias_word`."""
    if BIAS_BF16:
        word = tl.load(w_ptr + bias_word + rows // 2, mask=mask, other=0)
        bits = ((word >> ((rows & 1) * 16)) & 0xFFFF) << 16
    else:
        bits = tl.load(w_ptr + bias_word + rows, mask=mask, other=0)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_act_kernel(
    x_ptr, routes_ptr, w13_ptr, act_ptr, K, H, I, bank_words, nblk, scales_at, bias_word,
    BIAS_BF16: tl.constexpr, BLOCK_I: tl.constexpr, NB: tl.constexpr,
):
    route = tl.program_id(0)  # n * K + k
    i_offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    slot = tl.load(routes_ptr + route)
    row_mask = (i_offs < I) & (slot >= 0)
    w = w13_ptr + slot.to(tl.int64) * bank_words
    gate_rows = 2 * i_offs  # [BLOCK_I] row 2i gate i, row 2i + 1 up i
    up_rows = gate_rows + 1
    x_row = x_ptr + (route // K) * H
    gate = tl.zeros([BLOCK_I], tl.float32)
    up = tl.zeros([BLOCK_I], tl.float32)
    for b0 in range(0, nblk, NB):
        gate += _mxfp4_dots(w, gate_rows * (nblk * 4), scales_at + gate_rows * nblk, x_row, b0, nblk, row_mask, NB)
        up += _mxfp4_dots(w, up_rows * (nblk * 4), scales_at + up_rows * nblk, x_row, b0, nblk, row_mask, NB)
    gate = tl.minimum(gate + _mxfp4_bias(w, bias_word, gate_rows, row_mask, BIAS_BF16), 7.0)
    up = tl.minimum(tl.maximum(up + _mxfp4_bias(w, bias_word, up_rows, row_mask, BIAS_BF16), -7.0), 7.0)
    z = gate * 1.702
    e = tl.exp(-tl.abs(z))  # sigmoid without overflow for large |z|
    act = (up + 1.0) * (gate * tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e)))
    tl.store(act_ptr + route * I + i_offs, tl.where(slot >= 0, act, 0.0), mask=i_offs < I)


@triton.jit
def _mxfp4_down_kernel(
    act_ptr, weights_ptr, routes_ptr, w2_ptr, out_ptr, H, I, bank_words, nblk, scales_at, bias_word,
    K: tl.constexpr, BIAS_BF16: tl.constexpr, BLOCK_H: tl.constexpr, NB: tl.constexpr, OUT_BF16: tl.constexpr,
):
    n = tl.program_id(0)
    h_offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h_offs < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for k in tl.static_range(K):  # unrolled over the top-k, as in quant_moe_gemm.py
        slot = tl.load(routes_ptr + n * K + k)
        weight = tl.load(weights_ptr + n * K + k).to(tl.float32)
        w = w2_ptr + slot.to(tl.int64) * bank_words
        mask = h_mask & (slot >= 0)
        y = tl.zeros([BLOCK_H], tl.float32)
        for b0 in range(0, nblk, NB):
            y += _mxfp4_dots(w, h_offs * (nblk * 4), scales_at + h_offs * nblk, act_ptr + (n * K + k) * I,
                             b0, nblk, mask, NB)
        y += _mxfp4_bias(w, bias_word, h_offs, mask, BIAS_BF16)
        acc += tl.where(slot >= 0, weight * y, 0.0)
    store_rounded(out_ptr + n * H + h_offs, acc, h_mask, OUT_BF16)


def projection_bytes(rows: int, columns: int, bias_dtype: torch.dtype) -> tuple[int, int, int]:
    """(scales_at, bias_at, end): byte offsets in an expert's row of a projection with `rows`
    outputs over `columns` inputs (moe/mxfp4_format.py's `ProjectionRows`)."""
    groups = columns // BLOCK
    scales_at = rows * groups * BLOCK_BYTES
    bias_at = scales_at + rows * groups
    return scales_at, bias_at, bias_at + rows * bias_dtype.itemsize


def _words(name: str, bank: torch.Tensor, need: int, what: str) -> torch.Tensor:
    """A uint8 bank [S, >= need] as the int32 words the kernels read."""
    if bank.dtype != torch.uint8 or bank.dim() != 2 or bank.shape[1] < need:
        raise ValueError(f"{name} must be a uint8 [S, >= {need}] bank ({what}), got {bank.dtype}{tuple(bank.shape)}")
    if bank.shape[1] > 1 and bank.stride(1) != 1:
        raise ValueError(f"{name}'s bank rows must be contiguous bytes")
    if bank.shape[1] % 4 or (bank.shape[0] > 1 and bank.stride(0) % 4) or bank.data_ptr() % 4:
        raise ValueError(f"{name}'s bank rows must start and end on 4-byte words, got rows of {bank.shape[1]} "
                         f"bytes, {bank.stride(0)} apart")
    return bank.view(torch.int32)


def mxfp4_slots_gemm(
    x: torch.Tensor,
    weights: torch.Tensor,
    routes: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    hidden: int,
    inter: int,
    bias_dtype: torch.dtype,
    act_blocks: tuple[int, int] = ACT_BLOCKS,
    down_blocks: tuple[int, int] = DOWN_BLOCKS,
    warps: tuple[int, int] = WARPS,
    landing: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_k weights[n, k] * gpt-oss expert at slot routes[n, k] of x[n]; routes of -1 add nothing.

    x [N, H] (bf16, fp16 or fp32), weights [N, K] (fp32 or bf16), routes [N, K] int32, w13 / w2
    uint8 slot banks (layout in the module docstring; rows 4-byte aligned, as wide as needed or
    wider); hidden = H, inter = I (multiples of 32); bias_dtype: the biases' dtype in the banks
    (bf16 or fp32). Returns [N, H] in x's dtype.
    act_blocks = (BLOCK_I, BLOCK_H) of the first kernel, down_blocks = (BLOCK_H, BLOCK_I) of the
    second (powers of two, capped at the problem's size); warps: each kernel's num_warps.
    landing: accepted and checked as quant_slots_gemm does (plain launches: nothing to enable).
    """
    n = x.shape[0]
    k = routes.shape[1] if routes.dim() == 2 else 0
    if hidden % BLOCK or inter % BLOCK or hidden <= 0 or inter <= 0:
        raise ValueError(f"MXFP4 experts need hidden and expert sizes that are multiples of {BLOCK}, "
                         f"got {hidden}, {inter}")
    if bias_dtype not in BIAS_DTYPES:
        raise ValueError(f"bias_dtype must be bf16 or fp32, got {bias_dtype}")
    if x.dim() != 2 or x.shape[1] != hidden or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be [N, {hidden}] bf16, fp16 or fp32, got {x.dtype}{tuple(x.shape)}")
    if weights.shape != routes.shape or routes.dim() != 2 or routes.shape[0] != n or routes.dtype != torch.int32:
        raise ValueError("weights and routes must be [N, K]; routes int32")
    s13, b13, end13 = projection_bytes(2 * inter, hidden, bias_dtype)
    s2, b2, end2 = projection_bytes(hidden, inter, bias_dtype)
    w13_words = _words("w13", w13, end13, f"gate_up: {2 * inter} rows of {hidden} MXFP4, scales, biases")
    w2_words = _words("w2", w2, end2, f"down: {hidden} rows of {inter} MXFP4, scales, biases")
    if w13.shape[0] != w2.shape[0]:
        raise ValueError(f"w13 has {w13.shape[0]} slots, w2 {w2.shape[0]}")
    if landing is not None and (landing.dim() != 1 or landing.dtype != torch.int32 or landing.device != x.device):
        raise ValueError(f"landing must be a plan's [P] int32 copy_slots on {x.device}")
    x, weights, routes = x.contiguous(), weights.contiguous(), routes.contiguous()
    out = torch.empty_like(x)  # [N, H]
    if n * k == 0:
        return out.zero_()
    act = torch.empty((n * k, inter), dtype=torch.float32, device=x.device)  # [N*K, I]
    bias_bf16 = bias_dtype == torch.bfloat16
    bi = min(act_blocks[0], triton.next_power_of_2(inter))
    _mxfp4_act_kernel[(n * k, triton.cdiv(inter, bi))](
        x, routes, w13_words, act, k, hidden, inter, w13_words.stride(0), hidden // BLOCK, s13, b13 // 4,
        BIAS_BF16=bias_bf16, BLOCK_I=bi, NB=_blocks_per_pass(min(act_blocks[1], hidden)), num_warps=warps[0])
    bh = min(down_blocks[0], triton.next_power_of_2(hidden))
    _mxfp4_down_kernel[(n, triton.cdiv(hidden, bh))](
        act, weights, routes, w2_words, out, hidden, inter, w2_words.stride(0), inter // BLOCK, s2, b2 // 4,
        K=k, BIAS_BF16=bias_bf16, BLOCK_H=bh, NB=_blocks_per_pass(min(down_blocks[1], inter)),
        OUT_BF16=x.dtype == torch.bfloat16, num_warps=warps[1])
    return out


def _blocks_per_pass(elements: int) -> int:
    """Blocks a pass covers for a tile `elements` wide: a power of two, at least one."""
    return max(1, triton.next_power_of_2(max(elements, 1)) // BLOCK)
