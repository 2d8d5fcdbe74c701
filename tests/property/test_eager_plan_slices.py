"""The eager MoE layer plans at most MAX_PLAN_ROUTES routes at once: longer inputs (short prefill
chunks) run as token slices. Slicing must not change what a token computes: on a policy that
computes every expert on the device the output is bit-equal to one plan over all tokens, with a
cache that holds one layer's experts and with one that holds them all."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import freetoken.moe.eager_layer as eager_layer
from freetoken.cache.host_pool import HostExpertPool
from freetoken.cache.offloaded_moe import OffloadedExperts
from freetoken.cache.slot_cache import SlotCache
from freetoken.config import ModelConfig
from freetoken.kernels.cpu.executor import CpuExpertExecutor
from freetoken.moe.planner import MAX_PLAN_ROUTES
from freetoken.moe.policy import sim_policy
from freetoken.moe.slot_gemm import triton_slots_gemm
from freetoken.reference.expert_cache import share_q16


def _bits(bank: torch.Tensor) -> np.ndarray:
    return bank.view(torch.int16).numpy().view("uint16")


def _layer_outputs(pool, cfg, policy: str, slots: int, inputs, plan_sizes: list[int]) -> list[torch.Tensor]:
    cache = SlotCache(pool, slots, sim_policy(policy, background_fills=False), share_q16(0.5), "cpu",
                      torch.bfloat16, planner="triton")
    plan = cache.plan

    def counted(layer, ids):
        plan_sizes.append(ids.numel())
        return plan(layer, ids)

    cache.plan = counted
    executor = CpuExpertExecutor(_bits(pool.w13), _bits(pool.w2), threads=1) if policy != "transfer" else None
    try:
        moe = OffloadedExperts(cache, executor, [triton_slots_gemm] * cfg.num_layers, stream_min_tokens=None)
        return [moe.experts(layer, x, w, ids) for layer, (x, w, ids) in enumerate(inputs)]
    finally:
        if executor is not None:
            executor.close()


@pytest.mark.parametrize("policy,slots", [("transfer", 8), ("transfer", None), ("hybrid", 6)])
def test_token_slices_compute_what_one_plan_computes(policy, slots, make_checkpoint, monkeypatch):
    model_dir = make_checkpoint("qwen3_moe", "tiny", seed=3)
    cfg = ModelConfig.from_dir(model_dir)
    pool = HostExpertPool.load(model_dir, cfg)
    slots = slots or cfg.num_layers * cfg.num_experts  # None: every expert of every layer fits
    n = 3 * (MAX_PLAN_ROUTES // cfg.top_k) + 5  # three whole slices and a part
    g = torch.Generator().manual_seed(1)
    inputs = [(torch.randn(n, cfg.hidden_size, generator=g).to(torch.bfloat16),
               torch.rand(n, cfg.top_k, generator=g).to(torch.bfloat16),
               torch.stack([torch.randperm(cfg.num_experts, generator=g)[: cfg.top_k] for _ in range(n)]))
              for _ in range(cfg.num_layers)]
    sliced_sizes, whole_sizes = [], []
    sliced = _layer_outputs(pool, cfg, policy, slots, inputs, sliced_sizes)
    monkeypatch.setattr(eager_layer, "MAX_PLAN_ROUTES", n * cfg.top_k)
    whole = _layer_outputs(pool, cfg, policy, slots, inputs, whole_sizes)
    assert max(sliced_sizes) <= MAX_PLAN_ROUTES and len(sliced_sizes) == 4 * cfg.num_layers
    assert whole_sizes == [n * cfg.top_k] * cfg.num_layers
    for got, want in zip(sliced, whole, strict=True):
        if policy == "transfer":
            assert torch.equal(got, want)
        else:  # which routes the CPU computes depends on the cache state each plan sees
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
