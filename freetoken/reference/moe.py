"""Reference semantics of the MoE layer: routing and SwiGLU experts, and gpt-oss's variants
(the softmax over the top-k logits; biased experts with the clamped SwiGLU).

Shape legend: N tokens, H hidden, E experts, K top-k, I expert intermediate.

Rounding points follow the Hugging Face implementations, so that bf16 results match theirs:
router softmax in fp32; top-k weights cast to the activation dtype (Mixtral keeps them fp32
until the weighted expert output is rounded); each expert's weighted output rounded to the
activation dtype and accumulated in expert order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_fp32: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [N, E] -> (weights [N, K], expert ids [N, K] int64)."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [N, E] fp32
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [N, K]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not weights_fp32:
        weights = weights.to(router_logits.dtype)
    return weights, ids


def route_by_logits(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_fp32: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [N, E] -> (weights [N, K], expert ids [N, K] int64): `route` with its
    selection made on the logits, and ties going to the lower expert id.

    The twin of kernels/triton/routing.py. The experts are chosen by a stable descending sort
    of the logits widened to fp32 (softmax is monotonic, so this is the top-k of the
    probabilities); the weights are the same fp32 softmax probabilities, gathered, renormalised
    and cast as `route` does. So the result equals `route`'s bit for bit, except where the
    top-k meets equal fp32 probabilities: tied logits, or distinct logits whose probabilities
    round to the same fp32 value (e.g. both underflow to 0). There torch.topk's order and choice
    are unspecified; here they are deterministic (lower id first)."""
    logits = router_logits.float()  # [N, E]
    probs = torch.softmax(logits, dim=-1)  # [N, E] fp32, as in `route`
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]  # [N, K]
    weights = probs.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not weights_fp32:
        weights = weights.to(router_logits.dtype)
    return weights, ids


def route_top_k_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing: the top-k logits, then a softmax over those k alone (in the logits'
    dtype). router_logits [N, E] -> (weights [N, K], expert ids [N, K] int64)."""
    values, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1), ids


CLAMPED_SWIGLU_ALPHA = 1.702  # the sigmoid's slope
CLAMPED_SWIGLU_LIMIT = 7.0  # gate clamped above, up clamped to [-limit, limit]


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's activation: (up + 1) * gate * sigmoid(alpha * gate), with gate <= limit and
    |up| <= limit first."""
    gate = gate.clamp(max=CLAMPED_SWIGLU_LIMIT)
    up = up.clamp(-CLAMPED_SWIGLU_LIMIT, CLAMPED_SWIGLU_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * CLAMPED_SWIGLU_ALPHA))


def clamped_swiglu_expert(x: torch.Tensor, w13: torch.Tensor, b13: torch.Tensor, w2: torch.Tensor,
                          b2: torch.Tensor) -> torch.Tensor:
    """One gpt-oss expert on its tokens: x [n, H], w13 [2I, H] (gate rows, then up rows) with
    b13 [2I], w2 [H, I] with b2 [H] -> [n, H]. Each bias is added after its product, as the
    reference rounds."""
    gate, up = (F.linear(x, w13) + b13).chunk(2, dim=-1)  # [n, I] each
    return F.linear(clamped_swiglu(gate, up), w2) + b2


def swiglu_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert on its tokens: x [n, H], w13 [2I, H], w2 [H, I] -> [n, H]."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)  # [n, I] each
    return F.linear(F.silu(gate) * up, w2)


def swiglu_rows(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """An expert's share over its intermediate rows [first, last) (a split miss's half): x [n, H],
    w13 [2I, H], w2 [H, I] -> [n, H]. The two shares of a split sum to `swiglu_expert` up to rounding."""
    inter = w2.shape[1]
    gate = F.linear(x, w13[first:last])
    up = F.linear(x, w13[inter + first : inter + last])
    return F.linear(F.silu(gate) * up, w2[:, first:last])


def moe_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    expert=swiglu_expert,
) -> torch.Tensor:
    """Weighted sum of the routed experts. x [N, H], weights/ids [N, K], w13 [E, 2I, H], w2 [E, H, I].
    expert: (x [n, H], w13[e], w2[e]) -> [n, H], one expert on its tokens (`swiglu_expert`, or an
    expert format's, moe/biased_expert_format.py).

    An id of -1 contributes nothing (a route handled elsewhere, e.g. on the CPU)."""
    out = torch.zeros_like(x)  # [N, H]
    for e in torch.unique(ids[ids >= 0]).tolist():  # ascending expert order
        token_idx, k_idx = torch.where(ids == e)
        y = expert(x[token_idx], w13[e], w2[e])  # [n, H]
        y = y * weights[token_idx, k_idx, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out
