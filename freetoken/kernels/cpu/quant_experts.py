"""SwiGLU experts on the CPU straight from GGUF-quantized host banks (Numba).

Shape legend: N tokens, K top-k, H hidden, I expert intermediate, L layers, E experts per layer,
F flat expert ids (L*E, fid = layer * E + e), P routed (token, k) pairs.

    x [N, H] fp32, weights [N, K] fp32, ids [N, K] (fid, -1 = not for this executor)
    w13 uint8 [F, >= 2I * row_bytes(gu, H)]: gate rows [I], then up rows [I], of the layer's gu type
    w2 uint8 [F, >= H * row_bytes(d, I)]: down rows [H] of the layer's d type, then zero padding
    layer_types int32 [L, 2] = (gu type, d type) as GGUF type ids
    out [N, H] fp32 = sum_k weights[n, k] * down @ (silu(gate @ x[n]) * (up @ x[n]))

A row is the input dimension: consecutive blocks of the type (Q8_0: 32 values in 34 bytes,
f16 d then int8 q, value d*q; Q4_K/Q5_K: 256 values as 8 sub-blocks of 32, each with a 6-bit
scale and min, value d*sc*q - dmin*m; Q6_K: 256 values as 16 sub-blocks of 16, int8 scale,
value d*sc*(q - 32); F32/F16/BF16: plain values).

The work split is `experts.py`'s: each distinct expert is read once for all its tokens; phase 1
splits (expert, block of I) over threads, phase 2 splits H into row blocks and adds the experts
in ascending fid order. The vectors are quantized to int16 once, per chunk of 32 values
(`quant_dots.quantize_vector`): x's rows before phase 1, each pair's act row before phase 2
(the pollers' work items, which hold fp32 x/act only, quantize the rows they read, the same
way); quantized rows then dot them in integers, plain rows (F32/F16/BF16) dot the fp32 vector,
a work item's rows of one expert and one vector in one `vector_dots.dot_rows` call.

Error against the twin (`reference/quant_moe.py`: the `gguf` package's dequantization, then the
fp32 loop). A quantized vector v^ differs from v by at most rho_l = step_c / 2 at each element l
of chunk c (step_c = max|v| over the chunk / 32767; round to nearest; rho = 0 for a vector that
plain rows read). The integer sums are exact, so the kernel is the fp32 expert evaluated at x^
and act^. With G, U, D an expert's dequantized gate, up and down matrices, |.| elementwise:
    phase 1: |g^ - g| <= eg = |G| rho_x, |u^ - u| <= eu = |U| rho_x;
    act = silu(g) * u, |silu'| <= 1.1, so |act^ - act| <= ea = 1.1 eg (|u| + eu) + |silu(g)| eu;
    phase 2 quantizes act^, whose chunk maxima are at most those of |act| + ea:
        rho_a <= max over the chunk of (|act| + ea) / 65534;
    |y^ - y| <= |D| (ea + rho_a), and out adds sum_k |weights[n, k]| of that per token.
On top comes fp32 rounding, as before the integer path: at most 1e-5 * max|twin| (the scale
products and the order of additions differ from the twin's). tests/quant_banks.py computes this
bound from the dequantized banks and the tests check it; it is of the order of
max|x| / 65534 * sum|row| per projection (ggml's int8 activations: / 254).

fastmath as in `experts.py` (no nnan/ninf).

Caching: `cpu_moe_quant_tuned` is the one cached entry point (experts.py: Caching).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from freetoken.kernels.cpu import block_vectors, experts, quant_dots, vector_dots
from freetoken.kernels.cpu.experts import (
    BLOCK_H,
    BLOCK_I,
    FASTMATH,
    ID_RANGE_ERROR,
    _silu_mul,
    group_pairs,
    ids_in_range,
)
from freetoken.kernels.cpu.numba_cache import drop_stale_cache
from freetoken.kernels.cpu.quant_dots import BF16, F16, F32, Q4_K, Q5_K, Q6_K, Q8_0, quantize_vector
from freetoken.kernels.cpu.vector_dots import dot_rows
from freetoken.quant.ggml_blocks import BLOCK_SIZES

# The cached entry point compiles in the row dots and experts.py's helpers (numba_cache.py).
drop_stale_cache(__file__, [block_vectors.__file__, experts.__file__, quant_dots.__file__, vector_dots.__file__])

# type id -> (values per block, bytes per block), the types this kernel reads
BLOCKS = {int(t): size for t, size in BLOCK_SIZES.items() if int(t) in (F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K)}
TYPE_ERROR = "unsupported GGUF type in layer_types: the CPU kernel reads F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K"


@njit(inline="always")
def row_bytes(qtype, n):
    """Bytes of one row of n values of `qtype` (n a multiple of its block); -1: unknown type."""
    if qtype == Q8_0:
        return n // 32 * 34
    if qtype == Q4_K:
        return n // 256 * 144
    if qtype == Q5_K:
        return n // 256 * 176
    if qtype == Q6_K:
        return n // 256 * 210
    if qtype == F16 or qtype == BF16:
        return 2 * n
    if qtype == F32:
        return 4 * n
    return -1


@njit(fastmath=FASTMATH)
def vector_codes(m, n):
    """Empty (codes int16 [m, n], steps fp32 [m, n // 32], code sums int32 [m, n // 32])."""
    return np.empty((m, n), np.int16), np.empty((m, n // 32), np.float32), np.empty((m, n // 32), np.int32)


@njit(fastmath=FASTMATH)
def quantize_rows(v, codes):
    """Every row of v [m, n] into codes (`vector_codes`), chunk by chunk (quant_dots.py)."""
    q, d, s = codes
    for r in range(v.shape[0]):
        quantize_vector(v[r], q[r], d[r], s[r])


@njit(fastmath=FASTMATH)
def quant_gate_up_coded(u, i0, i1, fids, starts, pair_n, x, x_codes, w13, act, layout):
    """act[p, i0:i1] for every pair p of distinct expert u (phase 1 over one range of I), x's
    rows already quantized into x_codes, indexed like x."""
    layer_types, experts_per_layer, _ = layout
    xq, xd, xs = x_codes
    f = fids[u]
    gu = layer_types[f // experts_per_layer, 0]
    I = act.shape[1]
    rb = row_bytes(gu, x.shape[1])
    r = w13[f]
    gate, up = np.empty(i1 - i0, np.float32), np.empty(i1 - i0, np.float32)
    for p in range(starts[u], starts[u + 1]):
        n = pair_n[p]
        dot_rows(r, i0 * rb, rb, gu, x[n], xq[n], xd[n], xs[n], gate)
        dot_rows(r, (I + i0) * rb, rb, gu, x[n], xq[n], xd[n], xs[n], up)
        for i in range(i0, i1):
            act[p, i] = _silu_mul(gate[i - i0], up[i - i0])


@njit(fastmath=FASTMATH)
def quant_gate_up_range(u, i0, i1, fids, starts, pair_n, x, w13, act, layout):
    """`quant_gate_up_coded` for callers holding fp32 x only (the pollers' work items): it
    quantizes the rows of x that expert u's pairs read, then runs."""
    p0, p1 = starts[u], starts[u + 1]
    rows = np.empty((p1 - p0, x.shape[1]), np.float32)
    local_n = np.empty_like(pair_n)  # pair p of expert u reads local row p - p0
    for p in range(p0, p1):
        rows[p - p0] = x[pair_n[p]]
        local_n[p] = p - p0
    codes = vector_codes(p1 - p0, x.shape[1])
    quantize_rows(rows, codes)
    quant_gate_up_coded(u, i0, i1, fids, starts, local_n, rows, codes, w13, act, layout)


@njit(fastmath=FASTMATH)
def quant_down_coded(h0, h1, fids, starts, pair_n, pair_w, act, act_codes, w2, out, layout):
    """out[:, h0:h1] = the experts' down projections over that range of H, added in ascending
    fid order (phase 2); act's rows already quantized into act_codes."""
    layer_types, experts_per_layer, _ = layout
    aq, ad, as_ = act_codes
    out[:, h0:h1] = 0.0
    y = np.empty(h1 - h0, np.float32)
    for u in range(fids.shape[0]):
        f = fids[u]
        dt = layer_types[f // experts_per_layer, 1]
        rb = row_bytes(dt, act.shape[1])
        r = w2[f]
        for p in range(starts[u], starts[u + 1]):  # each out element still adds its pairs in order
            dot_rows(r, h0 * rb, rb, dt, act[p], aq[p], ad[p], as_[p], y)
            for h in range(h0, h1):
                out[pair_n[p], h] += pair_w[p] * y[h - h0]


@njit(fastmath=FASTMATH)
def quant_down_range(h0, h1, fids, starts, pair_n, pair_w, act, w2, out, layout):
    """`quant_down_coded` for callers holding fp32 act only (the pollers' work items): it
    quantizes every pair's act row, then runs."""
    codes = vector_codes(act.shape[0], act.shape[1])
    quantize_rows(act, codes)
    quant_down_coded(h0, h1, fids, starts, pair_n, pair_w, act, codes, w2, out, layout)


@njit(parallel=True, nogil=True, fastmath=FASTMATH)
def _quant_experts(x, fids, starts, pair_n, pair_w, w13, w2, layout, out):
    N, H = x.shape
    I = layout[2]
    P = pair_n.shape[0]
    x_codes = vector_codes(N, H)
    xq, xd, xs = x_codes
    for n in prange(N):
        quantize_vector(x[n], xq[n], xd[n], xs[n])
    act = np.empty((P, I), np.float32)  # [P, I]
    nb = (I + BLOCK_I - 1) // BLOCK_I
    for item in prange(fids.shape[0] * nb):
        u, b = divmod(np.int64(item), nb)
        i = b * BLOCK_I
        quant_gate_up_coded(u, i, min(i + BLOCK_I, I), fids, starts, pair_n, x, x_codes, w13, act, layout)
    act_codes = vector_codes(P, I)
    aq, ad, as_ = act_codes
    for p in prange(P):
        quantize_vector(act[p], aq[p], ad[p], as_[p])
    for blk in prange((H + BLOCK_H - 1) // BLOCK_H):
        h0 = np.int64(blk) * BLOCK_H
        quant_down_coded(h0, min(h0 + BLOCK_H, H), fids, starts, pair_n, pair_w, act, act_codes, w2, out, layout)


@njit(nogil=True)
def layout_fits(layout, H, w13_bytes, w2_bytes, F):
    """True when every layer's types are known, its rows fit the banks, and L*E == F."""
    layer_types, experts_per_layer, I = layout
    if layer_types.shape[0] * experts_per_layer != F:
        return False
    for layer in range(layer_types.shape[0]):
        gu = row_bytes(layer_types[layer, 0], H)
        dn = row_bytes(layer_types[layer, 1], I)
        if gu < 0 or dn < 0 or 2 * I * gu > w13_bytes or H * dn > w2_bytes:
            return False
    return True


@njit(nogil=True)
def quant_experts(x, weights, ids, w13, w2, layout, out):
    """`cpu_moe_quant` for compiled callers (the pollers); layout = (layer_types, E, I)."""
    N, H = x.shape
    if ids.shape[0] != N or weights.shape != ids.shape or out.shape != x.shape or w2.shape[0] != w13.shape[0]:
        raise ValueError("shape mismatch: need x/out [N,H], weights/ids [N,K], w13 and w2 [F, bytes]")
    if not layout_fits(layout, H, w13.shape[1], w2.shape[1], w13.shape[0]):
        raise ValueError("layer_types do not fit the banks: " + TYPE_ERROR + ", rows within the bank width")
    if not ids_in_range(ids, w13.shape[0]):
        raise ValueError(ID_RANGE_ERROR)
    fids, starts, pair_n, pair_w = group_pairs(weights, ids)
    if fids.shape[0] == 0:
        out[:] = 0.0
    else:
        _quant_experts(x, fids, starts, pair_n, pair_w, w13, w2, layout, out)


@njit(nogil=True, cache=True)
def cpu_moe_quant_tuned(x, weights, ids, w13, w2, layout, out):
    """`quant_experts` as a cached entry point for Python callers (experts.py: Caching)."""
    quant_experts(x, weights, ids, w13, w2, layout, out)


@dataclass(frozen=True)
class QuantLayout:
    """What the quantized banks alone do not say: each layer's (gu, d) GGUF types, experts per
    layer, and the model's hidden and intermediate sizes."""

    layer_types: np.ndarray  # int32 [L, 2]
    experts_per_layer: int
    hidden: int
    intermediate: int

    def __post_init__(self) -> None:
        lt = self.layer_types
        if lt.dtype != np.int32 or lt.ndim != 2 or lt.shape[1] != 2 or not lt.flags.c_contiguous or not len(lt):
            raise ValueError(f"layer_types must be a C-contiguous int32 [L, 2] array, got {lt.dtype} {lt.shape}")
        for layer, (gu, dn) in enumerate(lt.tolist()):
            for what, qtype, n in (("gate/up", gu, self.hidden), ("down", dn, self.intermediate)):
                if qtype not in BLOCKS:
                    raise ValueError(f"layer {layer} {what}: GGUF type {qtype}: {TYPE_ERROR}")
                if n % BLOCKS[qtype][0]:
                    raise ValueError(f"layer {layer} {what}: a row of {n} values is not whole blocks of "
                                     f"GGUF type {qtype} ({BLOCKS[qtype][0]} values)")

    def bank_bytes(self) -> tuple[int, int]:
        """The narrowest (w13, w2) bank widths that hold every layer's rows."""
        w13 = max(2 * self.intermediate * _row_bytes(gu, self.hidden) for gu in self.layer_types[:, 0].tolist())
        w2 = max(self.hidden * _row_bytes(dn, self.intermediate) for dn in self.layer_types[:, 1].tolist())
        return w13, w2

    def kernel_args(self) -> tuple:
        """The layout as the compiled kernels take it: (layer_types, E, I)."""
        return self.layer_types, np.int64(self.experts_per_layer), np.int64(self.intermediate)


def _row_bytes(qtype: int, n: int) -> int:
    elems, nbytes = BLOCKS[qtype]
    return n // elems * nbytes


def cpu_moe_quant(x, weights, ids, w13, w2, layout: QuantLayout, out) -> None:
    """out[N, H] = the weighted SwiGLU experts of every routed id, from quantized banks (module
    docstring). x fp32 [N, H], weights fp32 [N, K], ids int32/int64 [N, K] (fids, -1 = skip),
    w13/w2 uint8 [F, bytes], out fp32 [N, H] (overwritten). The compiled call releases the GIL."""
    cpu_moe_quant_tuned(x, weights, ids, w13, w2, layout.kernel_args(), out)
