"""gpt-oss's experts on the CPU straight from MXFP4 host banks (Numba): biased projections and
the clamped SwiGLU, from the checkpoint's blocks as moe/mxfp4_format.py lays them out.

Shape legend: N tokens, K top-k, H hidden, I expert intermediate, F flat expert ids, P routed
(token, k) pairs, G = columns / 32 blocks per row.

    x [N, H] fp32, weights [N, K] fp32, ids [N, K] (fid, -1 = not for this executor)
    w13 uint8 [F, >= bytes]: blocks [2I, G_H, 16], scales [2I, G_H], bias [2I]; rows 2i gate i, 2i+1 up i
    w2 uint8 [F, >= bytes]:  blocks [H, G_I, 16], scales [H, G_I], bias [H]
    bias: fp32 or bf16 bytes (layout's bias code), as the checkpoint stores them
    out [N, H] fp32 = sum_k weights[n, k] * (down @ act + b_down),
        act = (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7)  (reference/moe.py)

A block's value l is FP4_VALUES[code_l] * 2**(e - 127) (quant/mxfp4.py: byte j holds value 2j in
its low nibble, 2j + 1 in its high one). A row dot multiplies each block's 32 values with x in
32-lane vectors, scales them by the block's power of two (exact) and sums the lanes once per row
(kernels/cpu/fp4_vectors.py), so no dequantized row is ever written.

The work split is `experts.py`'s: each distinct expert is read once for all its tokens; phase 1
splits (expert, block of I) over threads, phase 2 splits H into row blocks and adds the experts
in ascending fid order.

Error against the twin (moe/mxfp4_format.py's `expert_weights`, quant/mxfp4.py's exact
dequantization, then reference/moe.py's biased clamped-SwiGLU expert in fp32): x is used
unquantized, so the two differ only in the order of fp32 additions and in fastmath's exp.
With u = 2**-24, G, U, D an expert's dequantized gate, up and down matrices and |.|
elementwise, gamma_n = 2 n u (both sides' reordering):
    |g^ - g| <= eg = gamma_H (|G||x| + |b_g|),  |u^ - u| <= eu = gamma_H (|U||x| + |b_u|);
    act's slope is at most 1.1 (|u| + 1 + eu) in g and |glu| in u, so
        |act^ - act| <= ea = 1.1 eg (|u| + 1 + eu) + |glu| eu + 8 u |act|;
    |y^ - y| <= |D| ea + gamma_I (|D||act| + |b_d|), and out adds sum_k |weights[n, k]| of that,
    plus gamma_K times the sum of the terms' magnitudes.
tests/mxfp4_banks.py computes this bound from the dequantized banks and the tests check it.

fastmath as in `experts.py` (no nnan/ninf).

Caching: `cpu_moe_mxfp4_tuned` is the one cached entry point (experts.py: Caching).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from freetoken.kernels.cpu import block_vectors, experts, fp4_vectors
from freetoken.kernels.cpu.experts import BLOCK_H, BLOCK_I, FASTMATH, ID_RANGE_ERROR, group_pairs, ids_in_range
from freetoken.kernels.cpu.fp4_vectors import add_scaled, fp4_block, load_f32x32, sum32, zeros32
from freetoken.kernels.cpu.numba_cache import drop_stale_cache

# The cached entry point compiles in experts.py's helpers and the vectors' intrinsics (numba_cache.py).
drop_stale_cache(__file__, [block_vectors.__file__, experts.__file__, fp4_vectors.__file__])

BIAS_FP32, BIAS_BF16 = 0, 1  # the layout's bias code: how the banks store the biases
_ALPHA, _LIMIT = np.float32(1.702), np.float32(7.0)


@njit(inline="always")
def _scale(e):
    """2**(e - 127) of an E8M0 byte, exactly (e = 0 is fp32's subnormal 2**-127)."""
    if e == 0:
        return np.uint32(0x00400000).view(np.float32)
    return np.uint32(np.uint32(e) << np.uint32(23)).view(np.float32)


@njit(fastmath=FASTMATH, inline="always")
def _dot(r, blocks_at, scales_at, row, v):
    """Row `row` of a projection (blocks at r[blocks_at:], scales at r[scales_at:]) dot v [G * 32]
    (v of unit stride), in 32-lane vectors (fp4_vectors.py)."""
    groups = v.shape[0] // 32
    acc = zeros32()
    at = blocks_at + row * groups * 16
    for g in range(groups):
        # fp4_block's lanes are twice the values: the half goes into the scale (exact)
        acc = add_scaled(acc, fp4_block(r, at + 16 * g), load_f32x32(v, 32 * g),
                         _scale(r[scales_at + row * groups + g]) * np.float32(0.5))
    return sum32(acc)


@njit(inline="always")
def _bias(r, bias_at, row, code):
    """Bias `row` of a projection whose biases start at r[bias_at]."""
    if code == BIAS_BF16:
        o = bias_at + 2 * row
        bits = np.uint32(np.uint32(r[o]) | np.uint32(np.uint32(r[o + 1]) << np.uint32(8)))
        return np.uint32(bits << np.uint32(16)).view(np.float32)
    o = bias_at + 4 * row
    low = np.uint32(np.uint32(r[o]) | np.uint32(np.uint32(r[o + 1]) << np.uint32(8)))
    high = np.uint32(np.uint32(r[o + 2]) | np.uint32(np.uint32(r[o + 3]) << np.uint32(8)))
    return np.uint32(low | np.uint32(high << np.uint32(16))).view(np.float32)


@njit(fastmath=FASTMATH, inline="always")
def _clamped_swiglu(g, u):
    g = min(g, _LIMIT)
    u = max(min(u, _LIMIT), -_LIMIT)
    return (u + np.float32(1.0)) * (g / (np.float32(1.0) + np.exp(-_ALPHA * g)))


@njit(fastmath=FASTMATH)
def mxfp4_gate_up_range(u, i0, i1, fids, starts, pair_n, x, w13, act, layout):
    """act[p, i0:i1] for every pair p of distinct expert u (phase 1 over one range of I)."""
    code, _, I = layout
    H = x.shape[1]
    scales_at = 2 * I * H // 2
    bias_at = scales_at + 2 * I * (H // 32)
    r = w13[fids[u]]
    for i in range(i0, i1):
        bg, bu = _bias(r, bias_at, 2 * i, code), _bias(r, bias_at, 2 * i + 1, code)
        for p in range(starts[u], starts[u + 1]):
            n = pair_n[p]
            g = _dot(r, 0, scales_at, 2 * i, x[n]) + bg
            act[p, i] = _clamped_swiglu(g, _dot(r, 0, scales_at, 2 * i + 1, x[n]) + bu)


@njit(fastmath=FASTMATH)
def mxfp4_down_range(h0, h1, fids, starts, pair_n, pair_w, act, w2, out, layout):
    """out[:, h0:h1] = the experts' biased down projections over that range of H, added in
    ascending fid order (phase 2)."""
    code, _, I = layout
    H = out.shape[1]
    scales_at = H * I // 2
    bias_at = scales_at + H * (I // 32)
    out[:, h0:h1] = 0.0
    for u in range(fids.shape[0]):
        r = w2[fids[u]]
        for h in range(h0, h1):
            b = _bias(r, bias_at, h, code)
            for p in range(starts[u], starts[u + 1]):
                out[pair_n[p], h] += pair_w[p] * (_dot(r, 0, scales_at, h, act[p]) + b)


@njit(parallel=True, nogil=True, fastmath=FASTMATH)
def _mxfp4_experts(x, fids, starts, pair_n, pair_w, w13, w2, layout, out):
    H = x.shape[1]
    I = layout[2]
    act = np.empty((pair_n.shape[0], I), np.float32)  # [P, I]
    nb = (I + BLOCK_I - 1) // BLOCK_I
    for item in prange(fids.shape[0] * nb):
        u, b = divmod(np.int64(item), nb)
        i = b * BLOCK_I
        mxfp4_gate_up_range(u, i, min(i + BLOCK_I, I), fids, starts, pair_n, x, w13, act, layout)
    for blk in prange((H + BLOCK_H - 1) // BLOCK_H):
        h0 = np.int64(blk) * BLOCK_H
        mxfp4_down_range(h0, min(h0 + BLOCK_H, H), fids, starts, pair_n, pair_w, act, w2, out, layout)


@njit(nogil=True)
def mxfp4_experts(x, weights, ids, w13, w2, layout, out):
    """`cpu_moe_mxfp4` for compiled callers; layout = (bias code, E, I)."""
    N, H = x.shape
    code, _, I = layout
    if ids.shape[0] != N or weights.shape != ids.shape or out.shape != x.shape or w2.shape[0] != w13.shape[0]:
        raise ValueError("shape mismatch: need x/out [N,H], weights/ids [N,K], w13 and w2 [F, bytes]")
    item = 2 if code == BIAS_BF16 else 4
    if H % 32 or I % 32 or w13.shape[1] < 2 * I * (H // 32 * 17 + item) or w2.shape[1] < H * (I // 32 * 17 + item):
        raise ValueError("MXFP4 banks do not fit the layout: H and I must be multiples of 32, rows within the banks")
    if (N > 0 and x.strides[1] != 4) or w13.strides[1] != 1 or w2.strides[1] != 1:
        raise ValueError("x (float32), w13 and w2 need unit stride along their rows: the vector loads read them whole")
    if not ids_in_range(ids, w13.shape[0]):
        raise ValueError(ID_RANGE_ERROR)
    fids, starts, pair_n, pair_w = group_pairs(weights, ids)
    if fids.shape[0] == 0:
        out[:] = 0.0
    else:
        _mxfp4_experts(x, fids, starts, pair_n, pair_w, w13, w2, layout, out)


@njit(nogil=True, cache=True)
def cpu_moe_mxfp4_tuned(x, weights, ids, w13, w2, layout, out):
    """`mxfp4_experts` as a cached entry point for Python callers (experts.py: Caching)."""
    mxfp4_experts(x, weights, ids, w13, w2, layout, out)


@dataclass(frozen=True)
class Mxfp4Layout:
    """What MXFP4 banks alone do not say: how they store the biases, experts per layer, and the
    model's hidden and intermediate sizes (multiples of 32)."""

    bias_code: int  # BIAS_FP32 or BIAS_BF16
    experts_per_layer: int
    hidden: int
    intermediate: int

    def __post_init__(self) -> None:
        if self.bias_code not in (BIAS_FP32, BIAS_BF16):
            raise ValueError(f"bias code {self.bias_code}: the CPU kernel reads fp32 or bf16 biases")
        if self.hidden % 32 or self.intermediate % 32:
            raise ValueError(f"MXFP4 rows are whole blocks of 32: hidden {self.hidden}, intermediate "
                             f"{self.intermediate}")

    def bank_bytes(self) -> tuple[int, int]:
        """The narrowest (w13, w2) bank widths that hold an expert."""
        item = 2 if self.bias_code == BIAS_BF16 else 4
        H, I = self.hidden, self.intermediate
        return 2 * I * (H // 32 * 17 + item), H * (I // 32 * 17 + item)

    def kernel_args(self) -> tuple:
        """The layout as the compiled kernels take it: (bias code, E, I)."""
        return np.int64(self.bias_code), np.int64(self.experts_per_layer), np.int64(self.intermediate)


def cpu_moe_mxfp4(x, weights, ids, w13, w2, layout: Mxfp4Layout, out) -> None:
    """out[N, H] = the weighted biased clamped-SwiGLU experts of every routed id, from MXFP4 banks
    (module docstring). x fp32 [N, H], weights fp32 [N, K], ids int32/int64 [N, K] (fids, -1 =
    skip), w13/w2 uint8 [F, bytes], out fp32 [N, H] (overwritten). The compiled call releases the GIL."""
    cpu_moe_mxfp4_tuned(x, weights, ids, w13, w2, layout.kernel_args(), out)
