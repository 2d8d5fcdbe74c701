"""The adaptive split under CUDA graphs: a captured plan reads r from its device word at replay,
and a serving runner's captured steps feed the estimator and follow its ratio without being
captured again."""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.loader.synth import write_synthetic_checkpoint
from freetoken.reference.expert_cache import CacheState, share_q16
from freetoken.reference.fetch_rule import FetchRule

STEPS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("m") / "qwen3", "qwen3_moe", "tiny", seed=3)


def test_a_captured_plan_follows_the_ratio_word():
    from freetoken.kernels.device_cache_state import DeviceCacheState
    from freetoken.kernels.triton.plan import plan_layer_device
    from freetoken.moe.live_split import SplitWord

    E, S, K = 16, 16, 8
    fresh = DeviceCacheState.from_reference(CacheState(1, E, S), "cuda")
    state = DeviceCacheState.from_reference(CacheState(1, E, S), "cuda")
    ids = torch.arange(K, dtype=torch.int32, device="cuda")[None, :]  # [1, K], all misses
    word = SplitWord(0, "cuda")
    plan_layer_device(state, 0, ids, FetchRule.QSTAR, word.word)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = plan_layer_device(state, 0, ids, FetchRule.QSTAR, word.word)
    on_cpu = []
    for share in (0.0, 0.5, 1.0):
        for mine, theirs in zip((state.slot_of, state.fid_of_slot, state.last_used, state.last_active, state.step),
                                (fresh.slot_of, fresh.fid_of_slot, fresh.last_used, fresh.last_active, fresh.step),
                                strict=True):
            mine.copy_(theirs)  # the same cold cache before every replay
        word.set(share_q16(share))
        graph.replay()
        on_cpu.append(int((plan.routes < 0).sum()))
    assert on_cpu == [K, K // 2, 0]


def _greedy(model_dir, **params):
    config = EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", max_model_len=256,
                          moe_policy="hybrid", moe_cache_slots=10, moe_params=params)
    runner = ModelRunner(str(model_dir), config, rows=1)
    assert runner.graphs is not None
    slowed = []
    if runner.live_split is not None:  # the CPU branch's answers, as if 1000x slower
        record = runner.live_split.timings.cpu

        def slow(nbytes, seconds):
            slowed.append(nbytes)
            record(nbytes, seconds * 1000)

        runner.live_split.timings.cpu = slow
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    tokens = [int(runner.prefill(runner.row_pages(0), prompt)[0].argmax())]
    start = runner.split_ratio()
    for i in range(STEPS):
        logits = runner.decode([runner.row_pages(0)], [tokens[-1]], [len(prompt) + i])
        tokens.append(int(logits.argmax(-1)[0]))
    status = runner.status()
    runner.close()
    return tokens, start, status, slowed


def test_captured_steps_feed_the_split_and_follow_it(model_dir):
    static_tokens, static_start, static, _ = _greedy(model_dir, adaptive=False)
    tokens, start, status, slowed = _greedy(model_dir)
    assert static["split_ratio"] == static_start and not static["split"]["adaptive"]
    assert slowed and status["split"]["steps_observed"] > 0  # the probe resolved the steps' counters
    assert status["split_ratio"] > start + 0.1  # a slow CPU path sends more misses over PCIe
    assert status["decode_graphs"]["captured"] == [[1, 128]]  # one capture served every ratio
    # (bf16: a route's placement decides where its term is rounded, so tokens are compared
    # across placements in fp32 on the CPU, tests/test_live_split.py)
    assert len(tokens) == len(static_tokens) == STEPS + 1
