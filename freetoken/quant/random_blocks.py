"""Random rows of GGML blocks, for measuring and testing kernels without a quantizer: random bytes
are valid Q8_0 and K-quant blocks once their f16 scale fields hold finite, modest values (any
other byte is a quant, a packed scale or a packed bit, all of whose values are valid). Plain-float
rows (F32, F16, BF16) are random normal values.
"""

from __future__ import annotations

import numpy as np

from freetoken.quant.ggml_blocks import BLOCK_SIZES, GGMLType

# Byte offsets, within a block, of its f16 scale fields (ggml_blocks.py describes the layouts).
SCALE_FIELDS = {GGMLType.Q8_0: (0,), GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,)}


def random_rows(qtype: int, rows: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """`rows` rows of n values of `qtype` as flat uint8 bytes (row after row)."""
    qtype = GGMLType(qtype)
    if qtype in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        v = (rng.standard_normal(rows * n) * 0.1).astype(np.float32)
        if qtype == GGMLType.F16:
            return v.astype(np.float16).view(np.uint8)
        if qtype == GGMLType.BF16:
            return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return v.view(np.uint8)
    elems, nbytes = BLOCK_SIZES[qtype]
    if n % elems:
        raise ValueError(f"a {qtype.name} row holds whole blocks of {elems} values; got {n}")
    blocks = rng.integers(0, 256, (rows * n // elems, nbytes), dtype=np.uint8)
    for field in SCALE_FIELDS[qtype]:
        scale = (rng.random(blocks.shape[0]) * 0.01 + 0.001).astype(np.float16)
        blocks[:, field : field + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)
