"""The CPU executor's thread count following the free cores (moe/live_threads.py): each step's CPU
samples reach the twin (reference/thread_count.py) through the live split, the executor's next
calls run with the count it returns, and a served engine computes the same tokens."""

from __future__ import annotations

import random
from types import SimpleNamespace

from freetoken.cache.live_bandwidth import LiveBandwidths
from freetoken.kernels.cpu import executor as executor_module
from freetoken.moe.live_split import LiveSplit
from freetoken.moe.live_threads import LiveThreads
from freetoken.reference.adaptive_split import StepSamples, step_rate
from freetoken.reference.thread_count import ThreadParams, threads_trace
from tests.test_live_policy import serve_greedy
from tests.test_live_split import _Cache


def test_each_steps_cpu_samples_reach_the_twin_and_set_the_executors_threads():
    backend = SimpleNamespace(live=LiveBandwidths(), cache=_Cache())
    split = LiveSplit(backend, 25e9, 50e9)
    executor = SimpleNamespace(threads=8)
    live = LiveThreads(executor, ThreadParams(max_threads=8, window=2))
    split.on_step = live.fold
    rng = random.Random(3)
    rates, counts = [], []
    for step in range(80):
        samples = [] if step % 7 == 3 else [(1 << 20, rng.randint(50_000, 200_000)) for _ in range(2)]
        for nbytes, ns in samples:
            backend.live.cpu_expert.add(nbytes, ns)
        split.end_step()
        rates.append(step_rate(samples))
        counts.append(executor.threads)
    assert counts == threads_trace(8, rates, ThreadParams(max_threads=8, window=2))
    assert len(set(counts)) > 1  # the search probed other counts
    status = live.status()
    assert status["max"] == 8 and status["steps"] == 80 and status["threads"] == counts[-1]


def test_a_cpu_engine_with_the_live_split_moves_its_threads_and_computes_the_same_tokens(make_checkpoint, tmp_path,
                                                                                         monkeypatch):
    used = []
    original = executor_module.set_threads

    def set_threads(n):
        used.append(n)
        return original(n)

    monkeypatch.setattr(executor_module, "set_threads", set_threads)
    model_dir = make_checkpoint("qwen3_moe", "tiny", seed=8)

    def run(params):
        return serve_greedy(model_dir, "hybrid", tmp_path, params, cpu_threads=2)

    tokens, status, metrics = run({"adaptive": "true"})
    live = status["live_cpu_threads"]
    assert live["max"] == 2 and live["probes"] >= 1 and set(used) == {1, 2}  # its probe ran calls on 1 thread
    assert metrics["gauges"]["cpu_expert_threads"] == live["threads"]
    used.clear()
    fixed_tokens, fixed, _ = run({})
    assert fixed_tokens == tokens and fixed["live_cpu_threads"] is None and set(used) <= {2}


def test_from_a_measured_cpu_rate_the_search_starts_settled_and_searches_once_slower():
    """A machine serving as its profile measured runs no probe; one whose CPU rate falls below it
    by more than the twin's `change` searches."""
    executor = SimpleNamespace(threads=8)
    live = LiveThreads(executor, ThreadParams(max_threads=8, window=2), reference=1e9)
    assert live.status()["settled"] and live.status()["reference_cpu_expert_bytes_per_s"] == 1e9
    for _ in range(40):
        live.fold(StepSamples(cpu_expert=[(1_000, 1_000)]))  # 1e9 bytes/s
    assert executor.threads == 8 and live.status()["probes"] == 0
    for _ in range(2):  # one window
        live.fold(StepSamples(cpu_expert=[(1_000, 2_000)]))  # half as fast
    assert live.status()["probes"] == 1 and executor.threads == 7 and not live.status()["settled"]


def test_the_engine_takes_the_profiles_measured_cpu_rate_as_the_reference(make_checkpoint, tmp_path):
    from freetoken.config import EngineConfig, MoeConfig
    from freetoken.engine.model_runner import ModelRunner
    from freetoken.moe.bandwidth_profile import save_profile

    model_dir = make_checkpoint("qwen3_moe", "tiny", seed=8)
    path = tmp_path / "profiles.json"
    save_profile(path, {"gpu": "cpu", "expert_format": "bf16", "pcie_fill_Bps": 10e9, "cpu_expert_Bps": 7e9,
                        "concurrent": None, "date": "today"})
    for profile, reference in ((path, 7e9), (tmp_path / "none.json", None)):  # measured; the defaults
        config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=64,
                              moe=MoeConfig(policy="hybrid", cache_slots=8, cpu_threads=2, params={"adaptive": "true"},
                                            bw_profile=str(profile)))
        runner = ModelRunner(str(model_dir), config, rows=1)
        try:
            status = runner.live_threads.status()
            assert status["reference_cpu_expert_bytes_per_s"] == reference
            assert status["settled"] == (reference is not None)
        finally:
            runner.close()
