"""`--moe-policy auto`'s live choice (moe/live_policy.py): each decode step's period reaches the
twin (reference/policy_choice.py) at the next step's start, work between steps makes a period
unclean, the slot cache plans each step with its mode's share, and a served engine computes the
same tokens whatever mode each step ran in."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest

from freetoken.cache.live_bandwidth import LiveBandwidths
from freetoken.cache.slot_cache import CacheStats, SlotCache
from freetoken.config import EngineConfig, MoeConfig, SamplingParams
from freetoken.moe import live_policy
from freetoken.moe.live_policy import LivePolicyChoice
from freetoken.moe.live_split import LiveSplit
from freetoken.reference.expert_cache import Q16
from freetoken.reference.policy_choice import ChoiceParams, StepTiming, initial_choice, mode_ratio_q16, next_choice
from freetoken.server.prometheus import render_prometheus
from tests.test_live_split import _Cache

PARAMS = ChoiceParams(warmup=2, settle=1, measure=2, patience=6, period=40, window=3)


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000

    def __call__(self) -> int:
        return self.now


def test_each_steps_period_reaches_the_twin_and_the_cache_plans_with_its_mode(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(live_policy.time, "perf_counter_ns", clock)
    backend = SimpleNamespace(live=LiveBandwidths(), cache=_Cache())
    split = LiveSplit(backend, 25e9, 50e9)
    stats = backend.cache.stats = CacheStats(hits=[0], misses=[0])
    choice = LivePolicyChoice(backend.cache, split, 0, params=PARAMS)
    want = initial_choice(PARAMS)
    step_ns = {"hybrid": 30_000, "transfer": 10_000, "cpu": 50_000}
    last_ns = 0
    for step in range(30):
        interrupted = step == 12  # a prefill between steps 11 and 12
        if interrupted:
            choice.interrupt()
        choice.begin_step(1)
        if step:  # each step looked up 3 hits and 1 miss; an interrupted period says nothing of either
            want = next_choice(want, StepTiming(None if interrupted else last_ns, 1, split.state.target,
                                                None if interrupted else 0.75))
        assert choice.state == want
        assert backend.cache.ratio_q16 == mode_ratio_q16(want.mode, split.state.ratio_q16)
        last_ns = step_ns[want.mode]
        clock.now += last_ns
        stats.hits[0] += 3
        stats.misses[0] += 1
        choice.end_step()
    assert want.probes >= 1 and choice.mode == "transfer" and backend.cache.ratio_q16 == Q16
    status = choice.status()
    assert status["mode"] == "transfer" and sum(status["mode_steps"].values()) == 30
    assert all(status["mode_steps"][m] > 0 for m in ("hybrid", "transfer", "cpu"))
    assert status["last_probe_ms"]["transfer"] == 0.01


def serve_greedy(model_dir, policy: str, tmp_path, params: dict | None = None,
                 cpu_threads: int = 1) -> tuple[list[int], dict, dict]:
    """A CPU engine's 40 greedy tokens over 8 slots -> (tokens, cache status, metrics)."""
    from freetoken.engine.llm import AsyncLLM

    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=128,
                          moe=MoeConfig(policy=policy, cache_slots=8, cpu_threads=cpu_threads, params=params or {},
                                        bw_profile=str(tmp_path / "no-profile.json")))

    async def run():
        async with AsyncLLM.start(config) as llm:
            out = []
            sampling = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
            async for chunk in llm.generate([1, 2, 3, 4], sampling, "r"):
                out += chunk.token_ids
            return out, await llm.cache_status(), llm.metrics()

    return anyio.run(run)


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_cpu_engine_on_auto_probes_every_mode_and_computes_the_same_tokens(make_checkpoint, tmp_path, monkeypatch,
                                                                             adaptive):
    """Served on the CPU with a cache too small for the experts: auto runs hybrid's plan with the
    live choice, its probe runs each mode, the planner's share follows the mode, and the tokens
    are transfer's (placement is invisible in the output)."""
    monkeypatch.setattr(live_policy, "ChoiceParams", lambda: PARAMS)
    shares = []
    original = SlotCache.set_ratio_q16

    def set_ratio_q16(self, ratio_q16):
        shares.append(ratio_q16)
        original(self, ratio_q16)

    monkeypatch.setattr(SlotCache, "set_ratio_q16", set_ratio_q16)
    model_dir = make_checkpoint("qwen3_moe", "tiny", seed=8)
    tokens, status, metrics = serve_greedy(model_dir, "auto", tmp_path, {"adaptive": "true"} if adaptive else {})
    transfer_tokens, transfer, _ = serve_greedy(model_dir, "transfer", tmp_path)
    assert tokens == transfer_tokens
    assert status["policy"] == "hybrid" and transfer["live_policy"] is None
    live = status["live_policy"]
    assert live["probes"] >= 1 and sum(live["mode_steps"].values()) == len(tokens) - 1
    assert all(live["mode_steps"][m] > 0 for m in ("hybrid", "transfer", "cpu"))
    assert Q16 in shares and 0 in shares and any(0 < s < Q16 for s in shares)
    text = render_prometheus(metrics)
    assert f'freetoken_moe_policy_mode{{mode="{live["mode"]}"}} 1.0' in text
    assert "freetoken_moe_policy_probes_total" in text and "freetoken_expert_split_pcie_share" in text
    # the live split's estimates where hybrid's share follows them
    assert ('freetoken_expert_split_estimate_bytes_per_second{link="cpu_expert"}' in text) == adaptive
    assert (status["live_split"] is not None) == adaptive


def test_auto_keeps_resident_where_every_expert_fits_and_a_ratio_parameter_is_its_hybrid_share(
        make_checkpoint, tmp_path):
    from freetoken.engine.llm import AsyncLLM

    model_dir = make_checkpoint("qwen3_moe", "tiny", seed=8)

    async def status_of(moe: MoeConfig) -> dict:
        config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=128, moe=moe)
        async with AsyncLLM.start(config) as llm:
            return await llm.cache_status()

    every = anyio.run(status_of, MoeConfig(policy="auto", cpu_threads=1))
    assert every["policy"] == "resident" and every["live_policy"] is None
    fixed = anyio.run(status_of, MoeConfig(policy="auto", cache_slots=8, cpu_threads=1, params={"ratio": "0.5"}))
    assert fixed["policy"] == "hybrid" and fixed["live_policy"]["mode"] == "hybrid" and fixed["split_ratio"] == 0.5


@pytest.mark.parametrize("adaptive", [True, False])
def test_auto_hybrid_mode_follows_the_live_split_only_where_adaptive(adaptive):
    backend = SimpleNamespace(live=LiveBandwidths(), cache=_Cache())
    split = LiveSplit(backend, 25e9, 50e9)
    prior = split.state.ratio_q16
    backend.cache.stats = CacheStats(hits=[0], misses=[0])
    choice = LivePolicyChoice(backend.cache, split if adaptive else None, prior, params=PARAMS)
    hybrid_steps = 0
    for _ in range(16):  # PCIe measured 10x faster than the CPU: the split moves toward fetching
        choice.begin_step(1)
        if choice.mode == "hybrid":
            hybrid_steps += 1
            assert backend.cache.ratio_q16 == (split.state.ratio_q16 if adaptive else prior)
        backend.live.pcie_fill.add(10_000_000, 1_000_000)
        backend.live.cpu_expert.add(1_000_000, 1_000_000)
        choice.end_step()
    assert (split.state.ratio_q16 != prior) == adaptive and hybrid_steps > 4
