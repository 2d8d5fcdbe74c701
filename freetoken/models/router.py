"""The router every supported family shares: softmax over all experts, then top-k (renormalised
where the config says so). Rounding follows reference/moe.py's `route`. Options the config turns
on (gpt_oss): a bias on the logits, and the softmax taken over the top-k logits only
(`route_top_k_softmax`, which has no fused kernel: it runs as torch ops on every device).

Shape legend: N tokens, H hidden, E experts, K top-k.
"""

from __future__ import annotations

import torch

from freetoken.config import ModelConfig
from freetoken.models.ops import DenseOps
from freetoken.reference.moe import route_top_k_softmax


class Router:
    # Whether the top-k weights stay fp32 into the expert sum (a family that keeps them sets it in
    # its file); otherwise they are cast to the activation dtype first.
    weights_fp32 = False

    def __init__(self, config: ModelConfig, ops: DenseOps) -> None:
        self.top_k = config.top_k
        self.renormalize = config.norm_topk_prob
        self.softmax_over_top_k = config.router_softmax == "top_k"
        self.ops = ops

    def logits(self, x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, H], router [E, H], bias [E] -> logits [N, E]. The bias is added inside the linear
        op, before its one rounding (as transformers' biased nn.Linear router computes it)."""
        return self.ops.router_linear(x, router, bias)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [N, E] -> (weights [N, K], expert ids [N, K])."""
        if self.softmax_over_top_k:
            return route_top_k_softmax(logits, self.top_k)
        return self.ops.route(logits, self.top_k, self.renormalize, self.weights_fp32)
