"""The router every supported family shares: softmax over all experts, then top-k (renormalised
where the config says so). Rounding follows reference/moe.py's `route`.

Shape legend: N tokens, H hidden, E experts, K top-k.
"""

from __future__ import annotations

import torch

from freetoken.config import ModelConfig
from freetoken.models.ops import DenseOps


class Router:
    # Whether the top-k weights stay fp32 into the expert sum (a family that keeps them sets it in
    # its file); otherwise they are cast to the activation dtype first.
    weights_fp32 = False

    def __init__(self, config: ModelConfig, ops: DenseOps) -> None:
        self.top_k = config.top_k
        self.renormalize = config.norm_topk_prob
        self.ops = ops

    def logits(self, x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
        """x [N, H], router [E, H] -> logits [N, E]."""
        return self.ops.router_linear(x, router)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [N, E] -> (weights [N, K], expert ids [N, K])."""
        return self.ops.route(logits, self.top_k, self.renormalize, self.weights_fp32)
