"""The adaptive split end to end on the CPU: timings reach the estimator, its ratio reaches the
planners through the split word (the plan kernel reads it at run time), and placement never
changes what is computed."""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.moe.live_split import LiveSplit, SplitTimings, SplitWord
from freetoken.moe.planner import make_planner
from freetoken.reference.expert_cache import CacheState, share_q16
from freetoken.reference.fetch_rule import FetchRule

PROMPT = [7, 3, 11, 200, 5, 17, 42, 99]
STEPS = 24


def _runner(model_dir, **params) -> ModelRunner:
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=64, moe_policy="hybrid", moe_cache_slots=8,
                          cpu_threads=1, moe_params=params)
    return ModelRunner(str(model_dir), config, rows=1)


def _greedy(runner: ModelRunner) -> list[int]:
    tokens = [int(runner.prefill(runner.row_pages(0), PROMPT)[0].argmax())]
    while len(tokens) < STEPS:
        logits = runner.decode([runner.row_pages(0)], [tokens[-1]], [len(PROMPT) + len(tokens) - 1])
        tokens.append(int(logits[0].argmax()))
    return tokens


def test_the_plan_kernel_follows_the_word_it_is_given():
    """One SplitWord, rewritten between plans (as the engine does between replays): the device
    planner's q* follows it, as the twin's does at the same value."""
    ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]])
    word = SplitWord(0, "cpu")
    fetched = []
    for q16 in (0, share_q16(0.5), 65536):
        word.set(q16)
        assert int(word.word.item()) == q16
        dev, ref = (make_planner(kind, CacheState(1, 16, 16), "cpu") for kind in ("triton", "reference"))
        dev_plan, ref_plan = dev.plan(0, ids, FetchRule.QSTAR, word), ref.plan(0, ids, FetchRule.QSTAR, word)
        assert dev_plan.copies == ref_plan.copies
        fetched.append(len(dev_plan.copies))
    assert fetched == [0, 4, 8]


def test_stubbed_timings_move_the_ratio_and_the_word():
    word = SplitWord(0, "cpu")
    split = LiveSplit(word, pcie_bps=25e9, cpu_bps=25e9, source="test prior")
    assert word.q16 == share_q16(0.5)
    for _ in range(40):  # the CPU answers at a tenth of the prior's rate, PCIe as expected
        split.timings.cpu(1 << 20, (1 << 20) / 2.5e9)
        split.timings.pcie(1 << 20, (1 << 20) / 25e9)
        split.end_step()
    assert split.estimate.ratio == pytest.approx(25 / 27.5, abs=0.02)
    assert word.q16 == share_q16(split.estimate.ratio) == int(word.word.item())
    status = split.status()
    assert status["adaptive"] and status["steps_observed"] == 40 and status["prior"] == "test prior"


def test_measurements_in_flight_wait_for_the_next_step():
    timings = SplitTimings()
    landed = []
    timings.defer(lambda: bool(landed) and (timings.cpu(1000, 1e-6) or True))
    assert timings.take().cpu_bytes == 0  # not landed: kept
    landed.append(True)
    assert timings.take().cpu_bytes == 1000
    assert timings.take().cpu_bytes == 0  # resolved once only


def test_a_slow_cpu_path_moves_the_split_and_not_the_tokens(make_checkpoint):
    """The eager paths report their real bytes; the clock is stubbed: the CPU answers at a tenth
    of the PCIe fills' rate (the real times of a tiny model's copies on a shared 2-core box say
    nothing), so the split moves from the profile's share toward PCIe."""
    model_dir = make_checkpoint("qwen3_moe", "tiny", seed=4)
    static = _runner(model_dir, adaptive=False)
    assert static.live_split is None and static.status()["split"]["adaptive"] is False
    static_tokens, static_q16 = _greedy(static), static.slots.ratio_q16
    static.close()

    adaptive = _runner(model_dir)
    split = adaptive.live_split
    start = split.estimate.ratio
    seen = {"cpu": [], "pcie": []}
    for path, rate in (("cpu", 2.5e9), ("pcie", 25e9)):
        real = getattr(split.timings, path)

        def stubbed(nbytes: int, seconds: float, path=path, rate=rate, real=real) -> None:
            seen[path].append(nbytes)
            real(nbytes, nbytes / rate)

        setattr(split.timings, path, stubbed)
    tokens = _greedy(adaptive)
    status = adaptive.status()
    adaptive.close()
    assert seen["cpu"] and seen["pcie"]  # both eager paths reported the experts they moved
    assert split.estimate.ratio > start + 0.3  # more of the misses go over PCIe
    assert adaptive.slots.ratio_q16 == share_q16(split.estimate.ratio) != static_q16
    assert status["split_ratio"] == adaptive.slots.ratio_q16 / 65536 and status["split"]["steps_observed"] > 0
    assert status["split"]["live_policy"] is None  # (named hybrid: no choice among policies)
    assert tokens == static_tokens


def test_a_fixed_ratio_does_not_adapt(make_checkpoint):
    from freetoken.errors import CheckpointError

    runner = _runner(make_checkpoint("qwen3_moe", "tiny", seed=4), ratio=0.25)
    assert runner.live_split is None and runner.slots.ratio_q16 == share_q16(0.25)
    runner.close()
    with pytest.raises(CheckpointError, match="a fixed ratio does not adapt"):
        _runner(make_checkpoint("qwen3_moe", "tiny", seed=4), ratio=0.25, adaptive=True)


def test_the_split_is_exported_in_metrics_health_status_and_the_trace(make_checkpoint):
    import anyio

    from freetoken.config import SamplingParams
    from freetoken.engine.llm import AsyncLLM
    from freetoken.server.prometheus import render_prometheus
    from freetoken.trace import TraceRecorder

    model_dir = make_checkpoint("qwen3_moe", "tiny", seed=4)
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=64,
                          moe_policy="auto", moe_cache_slots=8, cpu_threads=1)

    async def main():
        async with AsyncLLM.start(config) as llm:
            async for _ in llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0), "r"):
                pass
            return llm.metrics(), llm.health(), await llm.cache_status()

    metrics, health, status = anyio.run(main)
    split = status["split"]
    assert split["adaptive"] and split["steps_observed"] > 0 and status["split_ratio"] == split["ratio"]
    assert status["split_ratio_source"].startswith("adaptive, from ")
    assert health["moe_split"]["adaptive"] and 0.0 <= health["moe_split"]["ratio"] <= 1.0
    gauges = metrics["gauges"]
    assert gauges["moe_split_pcie_share"] == split["ratio"]
    assert gauges["moe_split_cpu_expert_bytes_per_second"] == split["cpu_expert_Bps"] > 0
    chosen = [(labels["policy"], value) for labels, value in gauges["moe_auto_policy"]]
    assert sorted(chosen) == sorted((p, float(p == split["live_policy"])) for p in ("transfer", "hybrid", "cpu"))
    text = render_prometheus(metrics)
    assert f'freetoken_moe_auto_policy{{policy="{split["live_policy"]}"}} 1.0' in text
    for name in ("moe_split_pcie_share", "moe_split_pcie_fill_bytes_per_second",
                 "moe_split_cpu_expert_bytes_per_second"):
        assert f"\nfreetoken_{name} " in text, name

    rec = TraceRecorder()
    live = LiveSplit(SplitWord(0, "cpu"), 25e9, 50e9, "test prior", recorder=rec)
    live.timings.cpu(1 << 20, 1e-3)
    live.end_step()
    counters = {e["name"] for e in rec.to_chrome()["traceEvents"] if e["ph"] == "C"}
    assert {"moe_split/pcie_share", "moe_split/pcie_fill_GBps", "moe_split/cpu_expert_GBps"} <= counters


def test_a_captured_steps_probe_turns_counters_and_stamps_into_timings():
    """The probe's arithmetic, on CPU tensors standing in for the device's: per layer, CPU experts
    (misses less waited fills) over the ring-to-answer time, waited fills over posted-to-filled."""
    import numpy as np

    from freetoken.engine.graph_plane import LAYER_POINTS, GraphPlane
    from freetoken.engine.split_probe import SplitProbe

    class Clock:  # one cycle per nanosecond
        @staticmethod
        def duration_ns(cycles):
            return cycles

    plane = GraphPlane(3, "cpu")
    timings = SplitTimings()
    probe = SplitProbe(plane, timings, expert_bytes=1000, clock=Clock())
    assert plane.stamps is not None and plane.stamps.shape == (3, len(LAYER_POINTS))  # stamped without tracing
    assert plane.stamped == {"posted", "filled"}  # (and only where the probe reads)
    plane.counts[1] += torch.tensor([5, 4, 3, 1, 2, 8])  # hits, misses, fetched (1 in background), ...
    plane.counts[2] += torch.tensor([8, 0, 0, 0, 0, 8])  # all hits: its ring measures no CPU work
    plane.stamps[1] = torch.tensor([100, 200, 2200, 3000, 5000])  # start, posted, filled, computed, merged
    rings = np.array([[10, 4010, 2], [20, 30, 3], [0, 0, 0]])  # (ring, answer, layer + 1)
    probe.after_step(rings)
    got = timings.take()
    # layer 1: 4 misses - 2 waited fills = 2 experts on the CPU in 4000 ns; 2 fills in 2000 ns
    assert (got.cpu_bytes, got.pcie_bytes) == (2000, 2000)
    assert got.cpu_s == pytest.approx(4e-6) and got.pcie_s == pytest.approx(2e-6)
    probe.after_step(np.array([[0, 0, 0]]))  # a step that gained nothing observes nothing
    assert timings.take() == type(got)()


def test_auto_turns_into_transfer_when_the_cpu_path_crawls(make_checkpoint):
    """auto on a cache short of the pool is the adaptive hybrid split, which takes transfer's
    r = 1 once the estimates put r near it: while it does, no route goes to the CPU. The timing
    source is stubbed (both paths observed every step, the CPU at 1/250 of the link's rate).
    Tokens as ever."""
    model_dir = make_checkpoint("qwen3_moe", "tiny", seed=4)
    runner = ModelRunner(str(model_dir), EngineConfig(device="cpu", dtype="float32", max_model_len=96,
                                                      moe_policy="auto", moe_cache_slots=8, cpu_threads=1), rows=1)
    split = runner.live_split
    assert split is not None and split.choice == "hybrid"
    observe_cpu, observe_pcie = split.timings.cpu, split.timings.pcie
    split.timings.cpu = split.timings.pcie = lambda nbytes, seconds: None  # the engine's own reports

    def stubbed_step():
        observe_cpu(1 << 20, (1 << 20) / 0.1e9)
        observe_pcie(1 << 20, (1 << 20) / 25e9)

    stubbed_step()
    tokens = [int(runner.prefill(runner.row_pages(0), PROMPT)[0].argmax())]
    choices = []
    for i in range(40):
        stubbed_step()
        choice, routed_before = split.choice, sum(runner.slots.stats.cpu_routes)
        choices.append(choice)
        logits = runner.decode([runner.row_pages(0)], [tokens[-1]], [len(PROMPT) + i])
        tokens.append(int(logits[0].argmax()))
        if choice == "transfer":
            assert runner.slots.ratio_q16 == 65536 or split.choice != "transfer"
            assert sum(runner.slots.stats.cpu_routes) == routed_before  # transfer's plans: nothing on the CPU
    runner.close()
    assert choices[0] == "hybrid" and choices[-1] == "transfer"
    assert choices == sorted(choices, key=("hybrid", "transfer").index)  # one switch, no flapping
    static = _runner(model_dir, adaptive=False)
    want = [int(static.prefill(static.row_pages(0), PROMPT)[0].argmax())]
    for i in range(40):
        want.append(int(static.decode([static.row_pages(0)], [want[-1]], [len(PROMPT) + i])[0].argmax()))
    static.close()
    assert tokens == want
