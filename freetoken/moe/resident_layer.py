"""A layer whose experts all have fixed slots (`resident`, or a fixed placement with a slot for
every expert): no plan, no fills, no CPU branch, so both executors run only the slot GEMM.

Shape legend: N tokens, K top-k, H hidden, E experts.
"""

from __future__ import annotations

import torch

from freetoken.moe.slot_gemm import GemmFn


def eager_resident(cache, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gemm: GemmFn,
                   stream_min_tokens: int | None) -> torch.Tensor:
    """The eager form: the counts go straight to the host's stats (every route a hit). Prefill
    chunks group their tokens by expert (the grouped GEMM reads each expert once for all its
    tokens); the slot GEMM reads an expert once per routed token."""
    routes = (ids + cache.resident_base[layer]).to(torch.int32)  # [N, K]
    cache.stats.add(layer, ids.numel(), 0, 0, 0, 0, ids.numel())
    if stream_min_tokens is not None and x.shape[0] >= stream_min_tokens:
        base, E = cache.resident_base[layer], cache.pool.config.num_experts
        return cache.pool.format.prefill_gemm(layer)(x, weights, ids.to(torch.int32), cache.w13[base : base + E],
                                                     cache.w2[base : base + E])
    return gemm(x, weights, routes, cache.w13, cache.w2)


def captured_resident(plane, cache, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      gemm: GemmFn) -> torch.Tensor:
    """The capturable form: no host sync, the routes counted on the host once per replay (the
    graph plane's `count_resident`), the skipped phases stamped as instants."""
    n, k = ids.shape
    plane.count_resident(layer, n * k)  # every route a hit: counted on the host, per replay
    routes = torch.add(ids, cache.resident_base[layer], out=torch.empty_like(ids, dtype=torch.int32))
    plane.stamp(layer, "start", "filled")
    y = gemm(x, weights, routes, cache.w13, cache.w2)
    plane.stamp(layer, "computed", "merged")
    return y
