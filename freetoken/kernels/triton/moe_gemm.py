"""Fused MoE GEMM over cache slots (decode-oriented: N is a handful of tokens).

Shape legend: N tokens, K top-k, H hidden, I expert intermediate, S slots.
Twin: `freetoken.reference.moe_slots.moe_slots` (fp32 math, one rounding at the end), equal
within the tolerance stated there and registered in kernels/registry.py (the summation order
differs, so not bit for bit). Deterministic: the same inputs give the same bits on one device.

Two kernels, both deterministic (no atomics):
  1. act  [N*K, I] fp32: silu(x @ gate.T) * (x @ up.T) per routed (token, k), grid over
     (route, I blocks), looping over H; a route of -1 gives zeros and reads no weights.
  2. out  [N, H]: sum over k in order 0..K-1 of weight * act @ w2.T, grid over (token, H
     blocks), looping over k and I; rounded once to the output dtype.
Everything is loaded then widened to fp32 at once (the interpreter cannot do bf16 math), and
bf16 results are stored through `rounding.store_rounded`, which rounds the way the hardware cast does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton import pdl
from freetoken.kernels.triton.rounding import store_rounded

# Tuned for decode (benchmarks/tune_moe_gemm.py and benchmarks/decode_linear_probe.py; their
# results in benchmarks/results/): narrow rows give many programs and wide, contiguous loads
# along each row. A single token's down kernel wants rows of two, to have programs for every SM;
# a batch's wants wider ones, timed inside CUDA graphs as a step runs them (the tuning script's
# host launches dominate at these sizes and chose narrower ones).
# (BLOCK_I, BLOCK_H) of _act_kernel, (BLOCK_H, BLOCK_I) of _down_kernel, and each kernel's num_warps:
ACT_BLOCKS = (4, 1024)
DOWN_BLOCKS = (2, 1024)  # N = 1
DOWN_BLOCKS_BATCH = (8, 256)  # N > 1
WARPS = (2, 4)


@triton.jit
def _landing(slot, landing_ptr, num_landing, BLOCK_P: tl.constexpr):
    """Whether the fill kernel just before writes this slot: one of the plan's waited-for copies
    (`copy_slots`, -1 padded)."""
    p_offs = tl.arange(0, BLOCK_P)
    filled = tl.load(landing_ptr + p_offs, mask=p_offs < num_landing, other=-1)  # [BLOCK_P]
    landing = tl.sum((filled == slot).to(tl.int32), axis=0) > 0
    return landing & (slot >= 0)


@triton.jit
def _act_kernel(
    x_ptr, routes_ptr, w13_ptr, act_ptr, landing_ptr, num_landing, K, H, I,
    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, LANDING: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr,
):
    pdl.signal(PDL)
    route = tl.program_id(0)  # n * K + k
    i_offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    if LANDING:
        # Placed once the fill kernel before has passed its own wait (it signals after it), so the
        # routes and every slot it does not fill are final: a route to such a slot (a hit) is
        # computed while the fill still runs. Routes to the slots it fills wait for it, and so
        # does the first program, so that this grid's end still implies the fill's.
        slot = tl.load(routes_ptr + route)
        first_program = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
        if _landing(slot, landing_ptr, num_landing, BLOCK_P) | first_program:
            pdl.wait(PDL)
    else:
        pdl.wait(PDL)
        slot = tl.load(routes_ptr + route)
    i_mask = (i_offs < I) & (slot >= 0)
    x_row = x_ptr + (route // K) * H
    gate_rows = w13_ptr + slot.to(tl.int64) * (2 * I * H) + i_offs[:, None] * H  # [BLOCK_I, 1]
    up_rows = gate_rows + I * H
    gate = tl.zeros([BLOCK_I], tl.float32)
    up = tl.zeros([BLOCK_I], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h_offs = h0 + tl.arange(0, BLOCK_H)
        h_mask = h_offs < H
        xv = tl.load(x_row + h_offs, mask=h_mask, other=0.0).to(tl.float32)[None, :]
        w_mask = i_mask[:, None] & h_mask[None, :]
        g = tl.load(gate_rows + h_offs[None, :], mask=w_mask, other=0.0).to(tl.float32)
        u = tl.load(up_rows + h_offs[None, :], mask=w_mask, other=0.0).to(tl.float32)
        gate += tl.sum(g * xv, axis=1)
        up += tl.sum(u * xv, axis=1)
    e = tl.exp(-tl.abs(gate))  # sigmoid without overflow for large |gate|
    act = gate * tl.where(gate >= 0, 1.0 / (1.0 + e), e / (1.0 + e)) * up
    tl.store(act_ptr + route * I + i_offs, act, mask=i_offs < I)


@triton.jit
def _down_kernel(
    act_ptr, weights_ptr, routes_ptr, w2_ptr, out_ptr, H, I,
    K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr, OUT_BF16: tl.constexpr, PDL: tl.constexpr,
):
    pdl.enter(PDL)
    n = tl.program_id(0)
    h_offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h_offs < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    # Unrolled over the top-k (a model constant): the K experts' rows are independent loads the
    # compiler can issue together; a runtime loop waited for each expert's rows in turn.
    for k in tl.static_range(K):
        slot = tl.load(routes_ptr + n * K + k)
        weight = tl.load(weights_ptr + n * K + k).to(tl.float32)
        rows = w2_ptr + slot.to(tl.int64) * (H * I) + h_offs[:, None] * I  # [BLOCK_H, 1]
        y = tl.zeros([BLOCK_H], tl.float32)
        for i0 in range(0, I, BLOCK_I):
            i_offs = i0 + tl.arange(0, BLOCK_I)
            i_mask = (i_offs < I) & (slot >= 0)
            a = tl.load(act_ptr + (n * K + k) * I + i_offs, mask=i_mask, other=0.0)
            w = tl.load(rows + i_offs[None, :], mask=h_mask[:, None] & i_mask[None, :], other=0.0)
            y += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        acc += tl.where(slot >= 0, weight * y, 0.0)
    store_rounded(out_ptr + n * H + h_offs, acc, h_mask, OUT_BF16)


def moe_slots_gemm(
    x: torch.Tensor,
    weights: torch.Tensor,
    routes: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    act_blocks: tuple[int, int] = ACT_BLOCKS,
    down_blocks: tuple[int, int] | None = None,
    warps: tuple[int, int] = WARPS,
    landing: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_k weights[n, k] * SwiGLU expert at slot routes[n, k] of x[n]; routes of -1 add nothing.
    landing: the plan's `copy_slots` ([P] int32, -1 padded), given when `fill_slots` of that plan
    was launched just before (captured steps; a kernel between them that waits first, or one
    outside the PDL chain, keeps this safe): routes to other slots are then computed while that
    fill still runs (with PDL on), instead of waiting for it. Never changes the result.

    x [N, H] (bf16, fp16 or fp32), weights [N, K] (fp32 or bf16), routes [N, K] int32,
    w13 [S, 2I, H] (gate rows 0..I-1, up rows I..2I-1), w2 [S, H, I]. Returns [N, H] in x's dtype.
    act_blocks = (BLOCK_I, BLOCK_H) of the first kernel, down_blocks = (BLOCK_H, BLOCK_I) of the
    second (powers of two; capped at the problem's size; None: the measured choice for N);
    warps: each kernel's num_warps.
    """
    n, h = x.shape
    k = routes.shape[1]
    inter = w2.shape[2]
    if weights.shape != routes.shape or routes.shape[0] != n or routes.dtype != torch.int32:
        raise ValueError("weights and routes must be [N, K]; routes int32")
    if w13.shape[1:] != (2 * inter, h) or w2.shape[1:] != (h, inter) or w13.shape[0] != w2.shape[0]:
        raise ValueError(f"bank shapes {tuple(w13.shape)} / {tuple(w2.shape)} do not match x [N, {h}]")
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("slot banks must be contiguous")
    if landing is not None and (landing.dim() != 1 or landing.dtype != torch.int32 or landing.device != x.device):
        raise ValueError(f"landing must be a plan's [P] int32 copy_slots on {x.device}")
    x, weights, routes = x.contiguous(), weights.contiguous(), routes.contiguous()
    # (also without PDL, where the early path only costs the scan: so the interpreter runs it)
    landing_ptr = landing.contiguous() if landing is not None else routes  # unused without
    num_landing = landing_ptr.numel() if landing is not None else 0
    act = torch.empty((n * k, inter), dtype=torch.float32, device=x.device)  # [N*K, I]
    out = torch.empty_like(x)  # [N, H]
    pi, ph = triton.next_power_of_2(inter), triton.next_power_of_2(h)
    bi, bh = min(act_blocks[0], pi), min(act_blocks[1], ph)
    _act_kernel[(n * k, triton.cdiv(inter, bi))](
        x, routes, w13, act, landing_ptr, num_landing, k, h, inter, BLOCK_I=bi, BLOCK_H=bh,
        LANDING=landing is not None, BLOCK_P=triton.next_power_of_2(max(num_landing, 1)),
        num_warps=warps[0], **pdl.launch(x))
    down_blocks = down_blocks or (DOWN_BLOCKS if n == 1 else DOWN_BLOCKS_BATCH)
    bh, bi = min(down_blocks[0], ph), min(down_blocks[1], pi)
    _down_kernel[(n, triton.cdiv(h, bh))](
        act, weights, routes, w2, out, h, inter, K=k,
        BLOCK_H=bh, BLOCK_I=bi, OUT_BF16=x.dtype == torch.bfloat16, num_warps=warps[1],
        **pdl.launch(x),
    )
    return out
