"""gpt-oss's biased, clamped-SwiGLU experts over slots for long prefill chunks, as grouped GEMMs
over groups of slots whose weights are made (dequantized) one group at a time.

`slot_gemm.grouped_slots_gemm` computes every slot at once from bf16 banks; experts kept
quantized would need the whole layer dequantized for that (~6.4 GB at gpt-oss-120b's sizes), so
here the caller's `gate_up` and `down` make a group's weights, and each group runs two
`torch._grouped_mm` calls on its routed pairs.

Shape legend: N tokens, K top-k, H hidden, I expert intermediate, S slots, R slots with routed
pairs, P routed (token, k) pairs, g slots in a group, p pairs in a group.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate

import torch

from freetoken.reference.moe import clamped_swiglu

# slots [g] int64 on x's device -> (weights [g, rows, columns], bias [g, rows]), both in x's dtype
ProjectionWeights = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def grouped_biased_gemm(x: torch.Tensor, weights: torch.Tensor, routes: torch.Tensor, num_slots: int,
                        slots_per_group: int, gate_up: ProjectionWeights, down: ProjectionWeights) -> torch.Tensor:
    """x [N, H], weights [N, K], routes [N, K] (slots, -1: routed elsewhere, adds nothing) -> [N, H].
    gate_up(slots): (w13 [g, 2I, H], b13 [g, 2I]), rows interleaved as gpt-oss's checkpoint has them
    (row 2i gate i, row 2i+1 up i); down(slots): (w2 [g, H, I], b2 [g, H]). Only slots with
    routed pairs are asked for, at most slots_per_group at a time, and a group's gate_up weights
    are dropped before its down weights are made.

    Rounding: each pair's gate/up product, bias, clamped SwiGLU, down product, bias and weighting
    round to x's dtype where `reference.moe.clamped_swiglu_expert` and the expert loop round; a
    token's K weighted terms are summed in fp32 and rounded once, in a fixed order, as
    `slot_gemm.grouped_slots_gemm` does. CUDA's grouped GEMM takes bf16 only: the caller keeps
    other dtypes on CUDA off this path."""
    if slots_per_group < 1:
        raise ValueError(f"slots_per_group must be at least 1, got {slots_per_group}")
    if x.is_cuda and x.dtype != torch.bfloat16:
        raise ValueError(f"CUDA's grouped GEMM takes bf16 activations, got {x.dtype}: use the expert loop")
    n, k = routes.shape
    flat = routes.flatten().long()  # [N*K]
    keyed = torch.where(flat >= 0, flat, num_slots)  # unrouted pairs sort last
    order = torch.sort(keyed, stable=True).indices  # [N*K] pair indices grouped by slot
    counts = torch.bincount(keyed, minlength=num_slots + 1)[:num_slots]  # [S]
    counts_host = counts.tolist()  # the one host sync
    routed_host = [slot for slot, count in enumerate(counts_host) if count]
    if not routed_host:
        return torch.zeros_like(x)
    ends_host = list(accumulate(counts_host[slot] for slot in routed_host))  # each routed slot's run ends
    routed = torch.tensor(routed_host, device=x.device)  # [R] the slots with pairs, ascending
    routed_counts = counts[routed]  # [R]
    routed_ends = routed_counts.cumsum(0)  # [R] ends_host on the device
    # each sorted pair's slot as an index into `routed`, so a group's biases gather by pair
    pair_rank = torch.repeat_interleave(torch.arange(len(routed_host), device=x.device), routed_counts,
                                        output_size=ends_host[-1])  # [P]
    weight_of_pair = weights.flatten()
    terms = torch.zeros(n * k, x.shape[1], dtype=x.dtype, device=x.device)  # [N*K, H]; unrouted pairs stay 0
    # A group's weights are dropped as soon as their product is taken: what slots_per_group
    # bounds is the caller's memory budget.
    for first in range(0, len(routed_host), slots_per_group):
        last = min(first + slots_per_group, len(routed_host))
        lo, hi = ends_host[first - 1] if first else 0, ends_host[last - 1]
        pairs = order[lo:hi]  # [p]
        offs = (routed_ends[first:last] - lo).to(torch.int32)  # [g] each slot's end within the group
        local = pair_rank[lo:hi] - first  # [p] the pair's slot within the group
        slots = routed[first:last]
        w13, b13 = gate_up(slots)
        h13 = torch._grouped_mm(x[pairs // k], w13.transpose(1, 2), offs=offs)  # [p, 2I]
        del w13
        h13 += b13[local]
        act = clamped_swiglu(h13[:, 0::2], h13[:, 1::2]).contiguous()  # [p, I]
        del h13
        w2, b2 = down(slots)
        y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [p, H]
        del act, w2
        y += b2[local]
        y.mul_(weight_of_pair[pairs, None])  # computed in the weights' precision, rounded to y's dtype
        terms.index_copy_(0, pairs, y)
    return terms.view(n, k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)
