"""Invariant 1: cache size and policy change speed, never what is computed.

For every family (tiny presets), cache sizes {E, 2E, half, all} and every policy, greedy
tokens equal `resident`'s for 32 steps, and the logits stay within 1e-4 of the largest logit
(fp32: the GPU/CPU split only reorders a sum of per-expert terms).
"""

from __future__ import annotations

import pytest
import torch

from freetoken.config import SUPPORTED_ARCHS, EngineConfig, ModelConfig, MoeConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.moe.policy import sim_policy

STEPS = 32
TOLERANCE = 1e-4
POLICIES = ("transfer", "cpu", "static", "hybrid")


def _greedy(runner: ModelRunner, prompt: list[int], steps: int = STEPS) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of one sequence, and the logits of each step."""
    slot = runner.row_state_slot(0)  # (models with linear attention: the row's recurrent state)
    logits = [runner.prefill(runner.row_pages(0), prompt, state_slot=slot)[0]]
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < steps:
        logits.append(runner.decode([runner.row_pages(0)], [tokens[-1]], [len(prompt) + len(tokens) - 1],
                                    None if slot is None else [slot])[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


def _runner(model_dir, policy, slots=None, ratio=None, fetch_recurring=True):
    params = {"ratio": ratio, "fetch_recurring": fetch_recurring} if policy == "hybrid" else {}
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=64,
                          moe=MoeConfig(policy=policy, cache_slots=slots, cpu_threads=1, params=params))
    return ModelRunner(str(model_dir), config, rows=1)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_every_policy_and_cache_size_computes_the_same(arch, make_checkpoint):
    model_dir = make_checkpoint(arch, "tiny", seed=4)
    prompt = [7, 3, 11, 200, 5, 17, 42, 99]
    resident = _runner(model_dir, "resident")
    ref_tokens, ref_logits = _greedy(resident, prompt)
    cfg = resident.model_config
    E, pool = cfg.num_experts, cfg.num_sparse_layers * cfg.num_experts
    scale = ref_logits.abs().max()
    # (gpt-oss's biased experts run on the torch loop only: the policies that compute on the CPU
    # refuse them, tests/test_gpt_oss.py)
    policies = ("transfer",) if cfg.expert_bias else POLICIES
    for slots in sorted({E, 2 * E, pool // 2, pool}):
        for policy in policies:
            runner = _runner(model_dir, policy, slots, ratio=0.5 if policy == "hybrid" else None)
            tokens, logits = _greedy(runner, prompt)
            runner.close()
            where = f"{policy} with {slots}/{pool} slots"
            assert tokens == ref_tokens, where
            assert (logits - ref_logits).abs().max() / scale < TOLERANCE, where


def test_hybrid_split_really_uses_both_branches(make_checkpoint):
    """Guard against a vacuous invariance test: with a small cache and r = 0.5 the hybrid
    policy both fetches experts and routes experts to the CPU; with q* alone (no fetching of
    recurring misses) it computes the same tokens, with more of them on the CPU."""
    model_dir = make_checkpoint("qwen3_moe", "tiny", seed=4)
    runs = {}
    for fetch_recurring in (True, False):
        runner = _runner(model_dir, "hybrid", slots=8, ratio=0.5, fetch_recurring=fetch_recurring)
        tokens, _ = _greedy(runner, [1, 2, 3, 4])
        runs[fetch_recurring] = tokens, runner.slots.stats
        runner.close()
    (tokens, stats), (qstar_tokens, qstar_stats) = runs[True], runs[False]
    assert sum(stats.fetched) > 0 and sum(stats.cpu_routes) > 0 and sum(stats.hits) > 0
    assert tokens == qstar_tokens and sum(qstar_stats.cpu_routes) > sum(stats.cpu_routes)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_prefill_layer_streaming_computes_the_same(arch, make_checkpoint):
    """Whole-layer streaming through the first 2E slots (and through E slots, without overlap)
    gives resident's tokens; afterwards the buffers' layers are in the cache, so decode starts warm.
    A second prefill after decode copies the experts the decode cache holds (past the buffers)
    from there, leaves them in their slots, and takes only the others from the host."""
    model_dir = make_checkpoint(arch, "tiny", seed=4, layers=4)  # 4E experts: 3E slots leave E past the buffers
    prompt = list(range(40, 120, 3))  # 27 tokens: streamed (threshold 16), decode steps are not
    second = list(range(300, 200, -4))  # 25 tokens
    resident = _runner(model_dir, "resident")
    ref_tokens, ref_logits = _greedy(resident, prompt)
    ref_second = resident.prefill(resident.row_pages(0), second)
    E = ModelConfig.from_dir(model_dir).num_experts
    for slots in (E, 2 * E, 3 * E):
        config = EngineConfig(device="cpu", dtype="float32", max_model_len=64,
                              moe=MoeConfig(policy="hybrid", cache_slots=slots, params={"ratio": 0.5}, cpu_threads=1,
                                            prefill_stream_min_tokens=16))
        runner = ModelRunner(str(model_dir), config, rows=1)
        logits = runner.prefill(runner.row_pages(0), prompt)
        streamer = runner.model.backend.streamer
        assert streamer is not None and streamer.layers_streamed == runner.model_config.num_sparse_layers
        assert streamer.counts.on_device == 0  # (a cold cache)
        state = runner.slots.state
        cfg = runner.model_config
        sparse = [layer for layer in range(cfg.num_layers) if cfg.sparse_layers[layer]]
        assert all(state.slot_of[sparse[-1] * E + e] >= 0 for e in range(E))  # the last layer seeds the decode cache
        state.check()
        tokens, _ = _greedy(runner, prompt)
        assert tokens == ref_tokens, f"{slots} slots"
        assert (logits - ref_logits[0]).abs().max() / ref_logits.abs().max() < TOLERANCE

        state = runner.slots.state
        cached = {fid: state.slot_of[fid] for layer in sparse for fid in range(layer * E, (layer + 1) * E)
                  if state.slot_of[fid] >= streamer.keep_from}
        assert bool(cached) == (slots > 2 * E)  # decode filled the slots past the buffers
        before = streamer.counts.from_host
        logits = runner.prefill(runner.row_pages(0), second)
        assert streamer.counts.on_device == len(cached)
        assert streamer.counts.from_host - before == len(sparse) * E - len(cached)
        status = runner.status()
        assert status["prefill_experts_streamed"] == {"from_host": streamer.counts.from_host, "on_device": len(cached)}
        streamed = status["prefill_experts_streamed"]["from_host"]
        assert status["prefill_bytes_streamed"] == streamed * runner.pool.expert_bytes
        state = runner.slots.state
        assert all(state.slot_of[fid] == slot for fid, slot in cached.items())  # the decode cache kept them
        state.check()
        runner.close()
        assert (logits - ref_second).abs().max() / ref_second.abs().max() < TOLERANCE, f"{slots} slots"


def test_claim_layer_keeps_device_state_equal_to_the_reference(make_checkpoint):
    from freetoken.cache.host_pool import HostExpertPool
    from freetoken.cache.slot_cache import SlotCache

    model_dir = make_checkpoint("qwen3_moe", "tiny", seed=4)
    cfg = ModelConfig.from_dir(model_dir)
    pool = HostExpertPool.load(model_dir, cfg)
    E = cfg.num_experts
    hybrid = sim_policy("hybrid", background_fills=False)
    ref = SlotCache(pool, 3 * E // 2, hybrid, 1 << 15, "cpu", torch.float32, planner="reference")
    dev = SlotCache(pool, 3 * E // 2, hybrid, 1 << 15, "cpu", torch.float32, planner="triton")
    for layer, first in [(0, 0), (1, E // 2), (0, E // 2), (1, 0)]:
        ref.claim_layer(layer, first, first + E)
        dev.claim_layer(layer, first, first + E)
        assert dev.reference_state() == ref.state
        ref.state.check()


def test_inline_cpu_branch_computes_the_same(make_checkpoint):
    model_dir = make_checkpoint("qwen3_moe", "tiny", seed=4)
    prompt = [7, 3, 11, 200, 5, 17, 42, 99]
    expected, _ = _greedy(_runner(model_dir, "resident"), prompt)
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=64,
                          moe=MoeConfig(policy="hybrid", cache_slots=8, params={"ratio": 0.5}, cpu_threads=1,
                                        cpu_branch="inline"))
    runner = ModelRunner(str(model_dir), config, rows=1)
    tokens, _ = _greedy(runner, prompt)
    assert sum(runner.slots.stats.cpu_routes) > 0
    runner.close()
    assert tokens == expected
