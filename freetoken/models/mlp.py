"""The dense SwiGLU MLP: the MLP of non-sparse layers, and Qwen2-MoE's shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.models.weights import DenseMLPWeights


def swiglu(x: torch.Tensor, mlp: DenseMLPWeights) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, mlp.gate)) * F.linear(x, mlp.up), mlp.down)
