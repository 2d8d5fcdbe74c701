"""Hybrid's live split (moe/live_split.py): the samples the engine takes reach the twin
(reference/adaptive_split.py) once per decode step, and the slot cache plans with its answer."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import torch

from freetoken.cache.live_bandwidth import LiveBandwidths
from freetoken.config import EngineConfig, MoeConfig, SamplingParams
from freetoken.moe.live_split import LiveSplit
from freetoken.reference.adaptive_split import StepSamples, initial_state, next_state
from freetoken.reference.expert_cache import pcie_share


class _Cache:
    def __init__(self) -> None:
        self.ratio_q16 = -1
        self.ratio_device = torch.zeros(1, dtype=torch.int32)
        self.writes = 0

    def set_ratio_q16(self, value: int) -> None:
        self.ratio_q16, self.writes = value, self.writes + 1
        self.ratio_device.fill_(value)


def test_each_steps_samples_reach_the_twin_and_the_cache_plans_with_its_answer():
    backend = SimpleNamespace(live=LiveBandwidths(), cache=_Cache())
    split = LiveSplit(backend, 25e9, 50e9)
    assert backend.cache.ratio_q16 == initial_state(25e9, 50e9).ratio_q16  # the prior, from the start
    want = initial_state(25e9, 50e9)
    steps = [([(4_000_000, 400_000)], [(1_000_000, 1_000_000)]),  # PCIe 10 GB/s, CPU 1 GB/s
             ([(4_000_000, 200_000), (1_000, 0)], []),  # a zero-time sample is ignored
             ([], [(3_000_000, 1_000_000), (1_000_000, 1_000_000)])] * 4
    for pcie, cpu in steps:
        for nbytes, ns in pcie:
            backend.live.pcie_fill.add(nbytes, ns)
        for nbytes, ns in cpu:
            backend.live.cpu_expert.add(nbytes, ns)
        split.end_step()
        want = next_state(want, StepSamples(pcie_fill=pcie, cpu_expert=cpu))
        assert split.state == want
        assert backend.cache.ratio_q16 == want.ratio_q16 == int(backend.cache.ratio_device[0])
    assert split.ratio > initial_state(25e9, 50e9).ratio  # PCIe turned out 5-20x faster than the CPU
    status = split.status()
    assert status["steps"] == len(steps) and status["ratio"] == want.ratio and status["target"] == want.target
    assert status["recent"][-1] == [len(steps), want.ratio]
    assert 0 < status["changes"] <= len(steps)


def test_samples_between_steps_are_dropped_and_a_step_without_any_holds_the_split():
    backend = SimpleNamespace(live=LiveBandwidths(), cache=_Cache())
    split = LiveSplit(backend, 25e9, 50e9)
    backend.live.pcie_fill.add(10**9, 1_000)  # a prefill's layer streaming: not the split's work
    split.drop_pending()
    writes = backend.cache.writes
    split.end_step()
    assert split.state == next_state(initial_state(25e9, 50e9), StepSamples())
    assert backend.cache.writes == writes  # nothing changed, nothing written to the device word
    assert backend.live.pcie_fill.total == 1  # the display estimates keep every sample


def _run(model_dir, params: dict, tmp_path) -> tuple[list[int], dict]:
    from freetoken.engine.llm import AsyncLLM

    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=128,
                          moe=MoeConfig(policy="hybrid", cache_slots=8, params=params, cpu_threads=1,
                                        bw_profile=str(tmp_path / "no-profile.json")))

    async def run() -> tuple[list[int], dict]:
        async with AsyncLLM.start(config) as llm:
            out = []
            sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
            async for chunk in llm.generate([1, 2, 3, 4], sampling, "r"):
                out += chunk.token_ids
            return out, await llm.cache_status()

    return anyio.run(run)


def test_a_cpu_engine_follows_its_own_timings_and_computes_the_same_tokens(make_checkpoint, tmp_path):
    """The eager CPU engine, no profile measured (the stated defaults are the prior): the split
    moves with what its fills and CPU calls take, and, placement being invisible in the output,
    the tokens are the fixed split's."""
    model_dir = make_checkpoint("qwen3_moe", "tiny", seed=8)
    tokens, status = _run(model_dir, {"adaptive": "true"}, tmp_path)
    fixed_tokens, fixed = _run(model_dir, {}, tmp_path)  # the default: the fixed split
    assert tokens == fixed_tokens
    live = status["live_split"]
    prior = pcie_share(live["prior_bytes_per_s"]["pcie_fill"], live["prior_bytes_per_s"]["cpu_expert"])
    assert live["steps"] == len(tokens) - 1  # one per decode step (the first token comes from the prefill)
    assert status["split_ratio"] == live["ratio"] != prior
    assert status["split_ratio_source"].startswith("live, from defaults")
    assert fixed["live_split"] is None and fixed["split_ratio"] == prior
