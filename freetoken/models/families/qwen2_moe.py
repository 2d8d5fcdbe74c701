"""Qwen2-MoE: biases on q/k/v, and a sigmoid-gated shared expert added to the routed experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.models.family import Family
from freetoken.models.mlp import swiglu
from freetoken.models.moe_layer import MoELayer
from freetoken.models.weights import MoEWeights


class SharedExpertMoELayer(MoELayer):
    def from_logits(self, layer: int, m: MoEWeights, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        out = super().from_logits(layer, m, x, logits)
        if m.shared is None:  # a config without shared_expert_intermediate_size
            return out
        return out + torch.sigmoid(F.linear(x, m.shared_gate)) * swiglu(x, m.shared)


QWEN2_MOE = Family("qwen2_moe", "Qwen2MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"),
                   moe_layer=SharedExpertMoELayer)
