"""Reference semantics of the MoE GEMM over cache slots (twin of kernels/triton/moe_gemm.py).

Shape legend: N tokens, K top-k, H hidden, I expert intermediate, S slots.

All math in fp32 from the stored weights, one rounding to x's dtype at the very end. This is
not the Hugging Face rounding (reference/moe.py rounds after every expert); it is the contract
of the fused kernel, which keeps fp32 until its single store.

Guarantee of the kernel against this twin (registered with the kernel in kernels/registry.py):
elementwise |kernel - twin| <= 2**-7 * |twin| + 2**-16 * max|twin|. The first term is one bf16
rounding step (the two fp32 sums, taken in different orders, may round to neighbouring bf16
values); the second covers the fp32 summation-order difference, relative to the output's scale.
"""

from __future__ import annotations

import torch

from freetoken.reference.moe import swiglu_rows


def moe_slots(
    x: torch.Tensor, weights: torch.Tensor, routes: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
) -> torch.Tensor:
    """x [N, H], weights/routes [N, K] (slot id, -1 = skip), w13 [S, 2I, H], w2 [S, H, I] -> [N, H]."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [N, H]
    inter = w2.shape[2]
    for n, row in enumerate(routes.tolist()):
        for k, slot in enumerate(row):
            if slot >= 0:
                y = swiglu_rows(x[n : n + 1].float(), w13[slot].float(), w2[slot].float(), 0, inter)  # [1, H]
                out[n] += weights[n, k].float() * y[0]
    return out.to(x.dtype)
