"""Reference semantics of the MoE GEMM over cache slots of GGML-quantized experts (twin of
kernels/triton/quant_moe_gemm.py).

Shape legend: N tokens, K top-k, H hidden, I expert intermediate, S slots.

The slot banks are dequantized by the `gguf` package's reference (`gguf.quants.dequantize`,
numpy fp32), then `reference.moe_slots.moe_slots` runs the expert loop in fp32 with one rounding
to x's dtype at the end, the rounding points of the fused kernel.

Guarantee of the kernel against this twin (kernels/specs/quant.py): elementwise
|kernel - twin| <= rel * |twin| + 2**-16 * max|twin|, rel one rounding step of the output dtype
(bf16 2**-7, fp16 2**-10, fp32 2**-20). The dequantized weights are equal bit for bit (the
"dequantize_rows" pair), so only the fp32 sums' order differs: the first term lets the two sums
round to neighbouring values of the output dtype, the second covers the order difference
relative to the output's scale, as for the bf16 slot GEMM.
"""

from __future__ import annotations

import numpy as np
import torch

from freetoken.reference.moe_slots import moe_slots


def dequantize_bank(bank: torch.Tensor, qtype: int, rows: int, n: int) -> torch.Tensor:
    """bank uint8 [S, >= rows * row bytes] -> fp32 [S, rows, n]: each slot's first `rows` rows
    of n elements of GGUF type `qtype` (the rest of a bank row is padding)."""
    import gguf
    from gguf.quants import dequantize

    elements, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    row = n // elements * nbytes
    data = np.ascontiguousarray(bank.cpu().numpy()[:, : rows * row]).reshape(bank.shape[0], rows, row)
    return torch.from_numpy(dequantize(data, gguf.GGMLQuantizationType(qtype)).copy())


def quant_moe_slots(
    x: torch.Tensor, weights: torch.Tensor, routes: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    gu_type: int, d_type: int, hidden: int, inter: int,
) -> torch.Tensor:
    """x [N, H], weights/routes [N, K] (slot id, -1 = skip), w13 / w2 uint8 slot banks (layout in
    kernels/triton/quant_moe_gemm.py) -> [N, H] in x's dtype."""
    w13_f = dequantize_bank(w13, gu_type, 2 * inter, hidden)  # [S, 2I, H]
    w2_f = dequantize_bank(w2, d_type, hidden, inter)  # [S, H, I]
    return moe_slots(x.cpu(), weights.cpu(), routes.cpu(), w13_f, w2_f)
