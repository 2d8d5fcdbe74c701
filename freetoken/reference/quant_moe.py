"""Reference semantics of SwiGLU experts over GGUF-quantized banks: the `gguf` package's
dequantization to fp32, then the fp32 expert loop of `reference.moe`.

The twin of kernels/cpu/quant_experts.py. Shape legend and bank layout as there: w13 uint8
[F, bytes] holds an expert's gate rows [I] then up rows [I] of its layer's gu type, w2 uint8
[F, bytes] its down rows [H] of the layer's d type (then padding); layer_types int32 [L, 2];
fid = layer * E + e.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf.quants import dequantize

from freetoken.reference.moe import moe_experts


def _rows(data: np.ndarray, qtype: int, rows: int, n: int) -> np.ndarray:
    """The first `rows` rows of n values of `qtype` in data (uint8), as fp32 [rows, n]."""
    nbytes = _row_bytes_of(qtype, n)
    return dequantize(data[: rows * nbytes].reshape(rows, nbytes), qtype).astype(np.float32).reshape(rows, n)


def _row_bytes_of(qtype: int, n: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    elems, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    return n // elems * nbytes


def dequantize_banks(w13: np.ndarray, w2: np.ndarray, layer_types: np.ndarray, experts_per_layer: int,
                     hidden: int, intermediate: int) -> tuple[np.ndarray, np.ndarray]:
    """fp32 w13 [F, 2I, H] and w2 [F, H, I] from the quantized banks."""
    F = w13.shape[0]
    out13 = np.empty((F, 2 * intermediate, hidden), np.float32)
    out2 = np.empty((F, hidden, intermediate), np.float32)
    for f in range(F):
        gu, dn = (int(t) for t in layer_types[f // experts_per_layer])
        out13[f] = _rows(w13[f], gu, 2 * intermediate, hidden)
        out2[f] = _rows(w2[f], dn, hidden, intermediate)
    return out13, out2


def quant_moe_experts(x: np.ndarray, weights: np.ndarray, ids: np.ndarray, w13: np.ndarray, w2: np.ndarray,
                      layer_types: np.ndarray, experts_per_layer: int, intermediate: int) -> np.ndarray:
    """out [N, H] fp32: the weighted SwiGLU experts of every routed id (-1 skipped)."""
    d13, d2 = dequantize_banks(w13, w2, layer_types, experts_per_layer, x.shape[1], intermediate)
    return moe_experts(torch.from_numpy(x), torch.from_numpy(weights), torch.from_numpy(ids).long(),
                       torch.from_numpy(d13), torch.from_numpy(d2)).numpy()
