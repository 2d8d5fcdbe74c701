"""The MoE layer: the router, then the routed experts through a MoE backend, which decides where
experts run (the engine's: freetoken/cache/). A family with more than routed experts (Qwen2-MoE's
shared expert) subclasses `from_logits` in its own file.

Shape legend: N tokens, H hidden, E experts, K top-k.
"""

from __future__ import annotations

from typing import Protocol

import torch

from freetoken.models.router import Router
from freetoken.models.weights import MoEWeights


class MoEBackend(Protocol):
    def experts(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [N, H], weights/ids [N, K] -> weighted expert sum [N, H]."""
        ...


class MoELayer:
    def __init__(self, router: Router, backend: MoEBackend) -> None:
        self.router = router
        self.backend = backend
        # Optional (layer, logits, weights, ids) -> (weights, ids): routing record/replay.
        self.routing_hook = None

    def __call__(self, layer: int, m: MoEWeights, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> the layer's output, the same shape."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, H]
        return self.from_logits(layer, m, x, self.router.logits(x, m.router, m.router_bias)).view(shape)

    def from_logits(self, layer: int, m: MoEWeights, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """x [N, H] and its router logits [N, E] -> the layer's output [N, H] (for steps whose
        logits come out of a fused kernel)."""
        weights, ids = self.router.route(logits)
        if self.routing_hook is not None:
            weights, ids = self.routing_hook(layer, logits, weights, ids)
        return self.backend.experts(layer, x, weights, ids)  # [N, H]
