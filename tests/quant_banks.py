"""Random GGUF-quantized expert banks for the CPU kernel's tests: random bytes are valid K-quant
and Q8_0 blocks once their f16 scale fields hold finite, modest values, so no quantizer is
needed; plain-float rows (F32, F16, BF16) are random normal values."""

from __future__ import annotations

import numpy as np

from freetoken.kernels.cpu.quant_experts import BF16, BLOCKS, F16, F32, Q4_K, Q5_K, Q6_K, Q8_0, QuantLayout

# Byte offsets, within a block, of its f16 scale fields.
SCALE_FIELDS = {Q8_0: (0,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,)}


def random_rows(qtype: int, rows: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """`rows` rows of n values of `qtype` as flat uint8 bytes."""
    if qtype in (F32, F16, BF16):
        v = (rng.standard_normal(rows * n) * 0.1).astype(np.float32)
        if qtype == F16:
            return v.astype(np.float16).view(np.uint8)
        if qtype == BF16:
            return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return v.view(np.uint8)
    elems, nbytes = BLOCKS[qtype]
    blocks = rng.integers(0, 256, (rows * n // elems, nbytes), dtype=np.uint8)
    for field in SCALE_FIELDS[qtype]:
        scale = (rng.random(blocks.shape[0]) * 0.01 + 0.001).astype(np.float16)
        blocks[:, field : field + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


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
