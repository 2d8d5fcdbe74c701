"""route_by_logits (the twin of the fused routing kernel) against route: the same bits where the
probabilities have no ties, and ties to the lower expert id where they do."""

from __future__ import annotations

import pytest
import torch

from freetoken.reference.moe import route, route_by_logits


def _distinct_logits(rows: int, experts: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every row a permutation of distinct multiples of 1/8 (exact in bf16 for up to 256 experts)."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.stack([torch.randperm(experts, generator=g) for _ in range(rows)]) - experts // 2
    jitter = torch.rand(rows, experts, generator=g) * 0.1 if dtype == torch.float32 else 0.0
    return (steps * 0.125 + jitter).to(dtype)  # [N, E]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("weights_fp32", [False, True])
@pytest.mark.parametrize(("experts", "top_k"), [(4, 1), (8, 2), (60, 4), (128, 8), (256, 8)])
def test_equals_route_without_ties(dtype, renormalize, weights_fp32, experts, top_k) -> None:
    logits = _distinct_logits(7, experts, dtype, seed=experts * 31 + top_k)
    probs = torch.softmax(logits.float(), dim=-1)
    assert (probs.sort(dim=-1).values.diff(dim=-1) > 0).all(), "the case must have no ties"
    want_w, want_ids = route(logits, top_k, renormalize, weights_fp32)
    got_w, got_ids = route_by_logits(logits, top_k, renormalize, weights_fp32)
    assert got_ids.dtype == torch.int64 and torch.equal(got_ids, want_ids)
    assert got_w.dtype == want_w.dtype and torch.equal(got_w, want_w)


def test_ties_go_to_the_lower_id() -> None:
    inf = float("inf")
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 0.0, -0.0, 3.0],  # three-way tie at the top; +0 and -0 tie too
            [-0.0, 0.0, 0.0, -1.0, -1.0, 2.0],
            [-inf, 5.0, -inf, -inf, 1.0, -inf],  # top-k reaching into the masked experts
        ]
    )
    weights, ids = route_by_logits(logits, 5, renormalize=False, weights_fp32=True)
    assert ids.tolist() == [[1, 2, 5, 0, 3], [5, 0, 1, 2, 3], [1, 4, 0, 2, 3]]
    probs = torch.softmax(logits, dim=-1)
    assert torch.equal(weights, probs.gather(-1, ids))


def test_bf16_logits_ties_and_cast() -> None:
    logits = torch.tensor([[0.5, 2.0, 2.0, 2.0]], dtype=torch.bfloat16)
    weights, ids = route_by_logits(logits, 2, renormalize=True, weights_fp32=False)
    assert ids.tolist() == [[1, 2]] and weights.dtype == torch.bfloat16
    assert weights.tolist() == [[0.5, 0.5]]
