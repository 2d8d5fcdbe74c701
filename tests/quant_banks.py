"""Random GGUF-quantized expert banks for the CPU kernel's tests, from the product's random block
rows (freetoken/quant/random_blocks.py), so no quantizer is needed."""

from __future__ import annotations

import numpy as np

from freetoken.kernels.cpu.quant_experts import QuantLayout
from freetoken.quant.random_blocks import random_rows

__all__ = ["make_quant_banks", "random_rows"]


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
