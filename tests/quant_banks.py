"""Random GGUF-quantized expert banks for the CPU kernel's tests, from the product's random block
rows (freetoken/quant/random_blocks.py), so no quantizer is needed."""

from __future__ import annotations

import numpy as np

from freetoken.kernels.cpu.quant_experts import QuantLayout
from freetoken.quant.random_blocks import random_rows

__all__ = ["activation_error_bound", "make_quant_banks", "random_rows"]


def make_quant_banks(layer_types, E: int, H: int, I: int, rng: np.random.Generator):
    """(w13, w2, layout): uint8 banks [L*E, width] as wide as the widest layer, zero padded."""
    layout = QuantLayout(np.ascontiguousarray(layer_types, np.int32), E, H, I)
    w13_bytes, w2_bytes = layout.bank_bytes()
    F = len(layer_types) * E
    w13 = np.zeros((F, w13_bytes), np.uint8)
    w2 = np.zeros((F, w2_bytes), np.uint8)
    for f in range(F):
        gu, dn = (int(t) for t in layout.layer_types[f // E])
        gate_up = random_rows(gu, 2 * I, H, rng)
        down = random_rows(dn, H, I, rng)
        w13[f, : gate_up.size] = gate_up
        w2[f, : down.size] = down
    return w13, w2, layout


PLAIN_TYPES = (0, 1, 30)  # F32, F16, BF16: rows that dot the fp32 vector, unquantized


def half_steps(v: np.ndarray) -> np.ndarray:
    """rho: half the int16 step of v's chunk of 32 at every element (v's last axis, whole chunks)."""
    chunks = np.abs(v).reshape(*v.shape[:-1], -1, 32).max(axis=-1, keepdims=True) / 65534.0
    return np.broadcast_to(chunks, (*chunks.shape[:-1], 32)).reshape(v.shape)


def activation_error_bound(x, weights, ids, w13, w2, layout) -> np.ndarray:
    """[N, H] float64: the bound on |kernel - twin| that int16 activation codes add (the derivation is
    quant_experts.py's docstring), from the dequantized banks; fp32 rounding not included."""
    from freetoken.reference.quant_moe import dequantize_banks

    E, I = layout.experts_per_layer, layout.intermediate
    d13, d2 = dequantize_banks(w13, w2, layout.layer_types, E, layout.hidden, I)
    x = x.astype(np.float64)
    bound = np.zeros(x.shape)
    for n, k in zip(*np.nonzero(ids >= 0), strict=True):
        f = int(ids[n, k])
        gu, dn = (int(t) for t in layout.layer_types[f // E])
        G, U = d13[f, :I].astype(np.float64), d13[f, I:].astype(np.float64)
        D = d2[f].astype(np.float64)
        rho_x = np.zeros(x.shape[1]) if gu in PLAIN_TYPES else half_steps(x[n])
        g, u = G @ x[n], U @ x[n]
        eg, eu = np.abs(G) @ rho_x, np.abs(U) @ rho_x
        silu = g / (1.0 + np.exp(np.minimum(-g, 80.0)))  # no overflow: silu(g) -> 0 there anyway
        ea = 1.1 * eg * (np.abs(u) + eu) + np.abs(silu) * eu
        rho_a = np.zeros(I) if dn in PLAIN_TYPES else half_steps(np.abs(silu * u) + ea)
        bound[n] += abs(float(weights[n, k])) * (np.abs(D) @ (ea + rho_a))
    return bound
