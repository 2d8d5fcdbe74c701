"""Fused MoE GEMM over cache slots holding GGML-quantized experts (decode-oriented: N is a handful
of tokens): `moe_gemm.moe_slots_gemm`'s contract, with the weights dequantized inside the kernels.

Shape legend: N tokens, K top-k, H hidden, I expert intermediate, S slots, W bank bytes.

A slot's banks are flat byte rows in GGML block layout (kernels/triton/quant_dequant.py):
  w13 [S, W13]: gate's I rows of row_bytes(gu_type, H), then up's I rows, then any padding;
  w2  [S, W2]:  down's H rows of row_bytes(d_type, I), then any padding (a bank is as wide as the
                widest layer's experts).
The types are compile-time constants, so each (gu_type, d_type) pair is one compiled variant.

Twin: `freetoken.reference.quant_moe_slots.quant_moe_slots` (the banks dequantized by
`gguf.quants.dequantize`, the fp32 expert loop, one rounding at the end), registered in
kernels/specs/quant.py; the dequantized weights are equal bit for bit, the sums' order differs.

The same two deterministic kernels as moe_gemm.py, with the same rounding points, their rows' dots
read a word at a time with the scales factored out (kernels/triton/quant_row_dots.py):
  1. act [N*K, I] fp32 (not rounded): silu(x @ gate.T) * (x @ up.T) per routed (token, k), grid
     over (route, I blocks), looping over H; a route of -1 gives zeros and reads no weights.
  2. out [N, H]: sum over k in order 0..K-1 of weight * act @ w2.T, grid over (token, H blocks),
     looping over k and I; rounded once to x's dtype.
Decode reads every routed expert's bytes once, so both grids are wide (many small row blocks)
so that every SM streams bytes. Plain launches: no programmatic dependent launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton.quant_dequant import TYPE_NAMES, row_bytes
from freetoken.kernels.triton.quant_row_dots import (
    ELEMENTS,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
    WORDS,
    block_dots,
    blocks_per_pass,
    word_view,
)
from freetoken.kernels.triton.rounding import store_rounded

# (BLOCK_I, BLOCK_H) of _quant_act_kernel: rows of gate and of up per program, elements of a pass
# along H; (BLOCK_H, BLOCK_I) of _quant_down_kernel per down type (N = 1, and N > 1); each kernel's
# num_warps. Chosen on the GPU with benchmarks/quant_gemm_probe.py --sweep at qwen3-30b-a3b's shape:
# K-quant down rows of 3 blocks run best in one masked pass of 4, Q6_K and Q8_0 rows a block a pass.
ACT_BLOCKS = (8, 512)
DOWN_BLOCKS = {Q4_K: (8, 1024), Q5_K: (8, 1024), Q6_K: (4, 256), Q8_0: (4, 256)}
DOWN_BLOCKS_BATCH = {Q4_K: (8, 1024), Q5_K: (8, 1024), Q6_K: (8, 256), Q8_0: (8, 256)}
WARPS = (2, 4)


@triton.jit
def _quant_act_kernel(
    x_ptr, routes_ptr, w13_ptr, act_ptr, K, H, I, bank_words, row_words, nblk,
    GU_TYPE: tl.constexpr, BLOCK_I: tl.constexpr, NB: tl.constexpr,
):
    route = tl.program_id(0)  # n * K + k
    i_offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    slot = tl.load(routes_ptr + route)
    row_mask = (i_offs < I) & (slot >= 0)
    gate_rows = slot.to(tl.int64) * bank_words + i_offs.to(tl.int64) * row_words  # [BLOCK_I] word offsets
    up_rows = gate_rows + I * row_words
    x_row = x_ptr + (route // K) * H
    gate = tl.zeros([BLOCK_I], tl.float32)
    up = tl.zeros([BLOCK_I], tl.float32)
    for b0 in range(0, nblk, NB):
        gate += block_dots(w13_ptr, gate_rows, x_row, b0, nblk, row_mask, GU_TYPE, NB)
        up += block_dots(w13_ptr, up_rows, x_row, b0, nblk, row_mask, GU_TYPE, NB)
    e = tl.exp(-tl.abs(gate))  # sigmoid without overflow for large |gate|
    act = gate * tl.where(gate >= 0, 1.0 / (1.0 + e), e / (1.0 + e)) * up
    tl.store(act_ptr + route * I + i_offs, act, mask=i_offs < I)


@triton.jit
def _quant_down_kernel(
    act_ptr, weights_ptr, routes_ptr, w2_ptr, out_ptr, H, I, bank_words, row_words, nblk,
    K: tl.constexpr, D_TYPE: tl.constexpr, BLOCK_H: tl.constexpr, NB: tl.constexpr, OUT_BF16: tl.constexpr,
):
    n = tl.program_id(0)
    h_offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h_offs < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    # Unrolled over the top-k (a model constant), as in moe_gemm.py: the K experts' rows are
    # independent loads the compiler can issue together.
    for k in tl.static_range(K):
        slot = tl.load(routes_ptr + n * K + k)
        weight = tl.load(weights_ptr + n * K + k).to(tl.float32)
        rows = slot.to(tl.int64) * bank_words + h_offs.to(tl.int64) * row_words  # [BLOCK_H]
        y = tl.zeros([BLOCK_H], tl.float32)
        for b0 in range(0, nblk, NB):
            y += block_dots(w2_ptr, rows, act_ptr + (n * K + k) * I, b0, nblk, h_mask & (slot >= 0), D_TYPE, NB)
        acc += tl.where(slot >= 0, weight * y, 0.0)
    store_rounded(out_ptr + n * H + h_offs, acc, h_mask, OUT_BF16)


def _check_bank(name: str, bank: torch.Tensor, need: int, what: str) -> None:
    if bank.dtype != torch.uint8 or bank.dim() != 2 or bank.shape[1] < need:
        raise ValueError(f"{name} must be a uint8 [S, >= {need}] bank ({what}), got {bank.dtype}{tuple(bank.shape)}")
    if bank.shape[1] > 1 and bank.stride(1) != 1:
        raise ValueError(f"{name}'s bank rows must be contiguous bytes")


def quant_slots_gemm(
    x: torch.Tensor,
    weights: torch.Tensor,
    routes: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    gu_type: int,
    d_type: int,
    hidden: int,
    inter: int,
    act_blocks: tuple[int, int] = ACT_BLOCKS,
    down_blocks: tuple[int, int] | None = None,
    warps: tuple[int, int] = WARPS,
    landing: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_k weights[n, k] * SwiGLU expert at slot routes[n, k] of x[n]; routes of -1 add nothing.

    x [N, H] (bf16, fp16 or fp32), weights [N, K] (fp32 or bf16), routes [N, K] int32, w13 uint8
    [S, >= 2*I*row_bytes(gu_type, H)], w2 uint8 [S, >= H*row_bytes(d_type, I)] (layout in the
    module docstring); gu_type / d_type: GGUF type ids (Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14);
    hidden = H, inter = I. Returns [N, H] in x's dtype.
    act_blocks = (BLOCK_I, BLOCK_H) of the first kernel, down_blocks = (BLOCK_H, BLOCK_I) of the
    second (powers of two, capped at the problem's size; None: the choice for N); warps: each
    kernel's num_warps.
    landing: accepted so that callers pass moe_slots_gemm's arguments unchanged, and checked the
    same way; these are plain launches that start after the fill before them has finished, so
    there is no early path for it to enable. Never changes the result.
    """
    n = x.shape[0]
    k = routes.shape[1] if routes.dim() == 2 else 0
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must be [N, {hidden}], got {tuple(x.shape)}")
    if weights.shape != routes.shape or routes.dim() != 2 or routes.shape[0] != n or routes.dtype != torch.int32:
        raise ValueError("weights and routes must be [N, K]; routes int32")
    gu_row, d_row = row_bytes(gu_type, hidden), row_bytes(d_type, inter)
    _check_bank("w13", w13, 2 * inter * gu_row, f"gate then up, {2 * inter} rows of {hidden} {TYPE_NAMES[gu_type]}")
    _check_bank("w2", w2, hidden * d_row, f"down, {hidden} rows of {inter} {TYPE_NAMES[d_type]}")
    if w13.shape[0] != w2.shape[0]:
        raise ValueError(f"w13 has {w13.shape[0]} slots, w2 {w2.shape[0]}")
    if landing is not None and (landing.dim() != 1 or landing.dtype != torch.int32 or landing.device != x.device):
        raise ValueError(f"landing must be a plan's [P] int32 copy_slots on {x.device}")
    x, weights, routes = x.contiguous(), weights.contiguous(), routes.contiguous()
    act = torch.empty((n * k, inter), dtype=torch.float32, device=x.device)  # [N*K, I]
    out = torch.empty_like(x)  # [N, H]
    w13_words, w2_words = word_view("w13", w13, gu_type), word_view("w2", w2, d_type)
    if n * k == 0:
        return out.zero_()
    bi = min(act_blocks[0], triton.next_power_of_2(inter))
    _quant_act_kernel[(n * k, triton.cdiv(inter, bi))](
        x, routes, w13_words, act, k, hidden, inter, w13_words.stride(0), gu_row // WORDS[gu_type][0].itemsize,
        hidden // ELEMENTS[gu_type],
        GU_TYPE=gu_type, BLOCK_I=bi, NB=blocks_per_pass(gu_type, min(act_blocks[1], hidden)), num_warps=warps[0])
    down_blocks = down_blocks or (DOWN_BLOCKS if n == 1 else DOWN_BLOCKS_BATCH)[d_type]
    bh = min(down_blocks[0], triton.next_power_of_2(hidden))
    _quant_down_kernel[(n, triton.cdiv(hidden, bh))](
        act, weights, routes, w2_words, out, hidden, inter, w2_words.stride(0), d_row // WORDS[d_type][0].itemsize,
        inter // ELEMENTS[d_type],
        K=k, D_TYPE=d_type, BLOCK_H=bh, NB=blocks_per_pass(d_type, min(down_blocks[1], inter)),
        OUT_BF16=x.dtype == torch.bfloat16, num_warps=warps[1])
    return out
