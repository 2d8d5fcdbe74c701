"""Reference semantics of the causal depthwise convolution + SiLU before Qwen3-Next / Qwen3.5's
linear attention (twin of kernels/triton/causal_conv.py).

Shape legend: B sequences, T tokens per sequence, C channels, W taps, S state slots in the pool.

Channel c of token t is silu(sum_j weight[c, j] * u[t + j, c]) over u = [the sequence's last W-1
inputs, x]: each output sees the W-1 inputs before it and itself. The pool keeps each sequence's
last W-1 inputs (zeros for a fresh one), read before and overwritten after, so decode steps and
prefill chunks continue one another. Rounding points as transformers' torch path: the sum in fp32,
rounded to x's dtype, then SiLU (in fp32) rounded again. A negative slot -(s + 1) names a read-only
row, as in reference/gated_delta.py: it starts from slot s and writes nothing.
"""

from __future__ import annotations

import torch

from freetoken.reference.gated_delta import check_distinct_slots, read_slots


def check_causal_conv_inputs(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor,
                             slots: torch.Tensor) -> None:
    """Raise ValueError naming the first argument whose shape or dtype does not fit the others."""
    if x.dim() != 3:
        raise ValueError(f"causal_conv1d: x {tuple(x.shape)} must be [B, T, C]")
    B, _, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 2:
        raise ValueError(f"causal_conv1d: weight {tuple(weight.shape)} must be [C={C}, W>=2]")
    W = weight.shape[1]
    if conv_pool.dim() != 3 or conv_pool.shape[1:] != (C, W - 1) or conv_pool.dtype != x.dtype:
        raise ValueError(f"causal_conv1d: conv_pool {conv_pool.dtype}{tuple(conv_pool.shape)} must be "
                         f"{x.dtype} [S, C={C}, W-1={W - 1}]")
    if slots.shape != (B,) or slots.dtype != torch.int64:
        raise ValueError(f"causal_conv1d: slots {slots.dtype}{tuple(slots.shape)} must be int64 [B={B}]")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor,
                  slots: torch.Tensor) -> torch.Tensor:
    """x [B, T, C]; weight [C, W]; conv_pool [S, C, W-1] (rows `slots` [B] read, then overwritten
    in place; negative: read-only rows) -> y [B, T, C] in x's dtype."""
    check_causal_conv_inputs(x, weight, conv_pool, slots)
    check_distinct_slots("causal_conv1d", slots)
    T, W = x.shape[1], weight.shape[1]
    inputs = torch.cat([conv_pool[read_slots(slots)], x.transpose(1, 2)], dim=2)  # [B, C, W-1+T]
    summed = torch.zeros(x.shape[0], x.shape[2], T, dtype=torch.float32, device=x.device)  # [B, C, T]
    for j in range(W):
        summed += weight[None, :, j, None].float() * inputs[:, :, j:j + T].float()
    written = slots >= 0
    conv_pool[slots[written]] = inputs[written, :, T:]
    y = torch.nn.functional.silu(summed.to(x.dtype).float()).to(x.dtype)
    return y.transpose(1, 2).contiguous()
