"""Live bandwidth estimates: the pure estimate over timing samples, the graph path's pure parts
over synthetic stamps and counts, and the eager path's samples from a real CPU engine run."""

from __future__ import annotations

import pytest
import torch

from freetoken.cache.live_bandwidth import LinkTimings, LiveBandwidths, Sample, estimate, link_gauges
from freetoken.cache.slot_cache import STAT_FIELDS
from freetoken.engine.graph_plane import LAYER_POINTS, cpu_experts, step_fill_timing


def test_the_estimate_is_the_median_rate_of_the_window():
    samples = [Sample(1000, 1000, 10.0), Sample(3000, 1000, 11.0), Sample(2000, 1000, 12.0),
               Sample(1, 1_000_000, 12.5)]  # a descheduled call: far off, and outvoted
    found = estimate(samples, now_s=13.0, window_s=30.0)
    assert found.bytes_per_s == pytest.approx(1.5e9)  # median of 1, 3, 2 and 0.000001 GB/s
    assert found.samples == 4 and found.window_s == pytest.approx(2.5)


def test_old_and_empty_samples_do_not_count():
    samples = [Sample(10**9, 10**9, 0.0), Sample(0, 500, 99.0), Sample(500, 0, 99.5)]
    assert estimate(samples, now_s=100.0, window_s=30.0) is None
    assert estimate(samples, now_s=20.0, window_s=30.0).bytes_per_s == pytest.approx(1e9)


def test_link_timings_keep_the_last_samples_and_count_all():
    link = LinkTimings(keep=3)
    for rate in (1, 1, 1, 5, 5, 5):
        link.add(rate * 100, 100, at_s=1.0)
    assert link.total == 6
    assert link.estimate(now_s=2.0).bytes_per_s == pytest.approx(5e9)
    with pytest.raises(ValueError, match="bytes >= 0"):
        link.add(-1, 10)


def test_status_and_gauges_say_none_before_any_sample():
    live = LiveBandwidths()
    live.cpu_expert.add(4_000, 1_000, at_s=50.0)
    status = live.status(now_s=51.0)
    assert status["pcie_fill"] == {"estimate": None, "samples_total": 0, "source": "nothing timed on this path"}
    assert status["cpu_expert"]["estimate"]["bytes_per_s"] == pytest.approx(4e9)
    gauges = dict((tuple(labels.values()), v) for labels, v in link_gauges(status, None))
    assert gauges == {("pcie_fill", "live"): None, ("pcie_fill", "profile"): None,
                      ("cpu_expert", "live"): pytest.approx(4e9), ("cpu_expert", "profile"): None}
    profile = {"pcie_fill_bytes_per_s": 25e9, "cpu_expert_bytes_per_s": 50e9}
    assert dict((tuple(lab.values()), v) for lab, v in link_gauges(status, profile))[("pcie_fill", "profile")] == 25e9


def _gained(fetched: int = 0, background: int = 0, misses: int = 0) -> list[int]:
    row = [0] * len(STAT_FIELDS)
    for name, value in (("fetched", fetched), ("background", background), ("misses", misses)):
        row[STAT_FIELDS.index(name)] = value
    return row


def _stamps(start: int, posted: int, filled: int) -> list[int]:
    points = dict(zip(LAYER_POINTS, [start, posted, filled, filled + 50, filled + 90], strict=True))
    return [points[p] for p in LAYER_POINTS]


def test_a_steps_fill_timing_from_synthetic_device_stamps():
    stamps = [[0] * len(LAYER_POINTS),  # a dense layer: no stamps
              _stamps(1_000, 1_100, 1_600),  # 3 experts filled in 500 ns
              _stamps(2_000, 2_050, 2_060),  # nothing filled for this step: its phase does not count
              _stamps(3_000, 3_100, 3_300)]  # 3 fetched, 1 of them in the background: 2 in 200 ns
    gained = [_gained(), _gained(fetched=3), _gained(fetched=1, background=1), _gained(fetched=3, background=1)]
    assert step_fill_timing(stamps, gained) == (5, 700)
    assert step_fill_timing(stamps[:1], gained[:1]) == (0, 0)


def test_cpu_experts_are_the_misses_not_filled_for_this_step():
    # 7 misses; 4 copied, 1 of those in the background (computed on the CPU this step)
    assert cpu_experts(_gained(misses=7, fetched=4, background=1)) == 4


def test_an_eager_cpu_engine_times_both_links(make_checkpoint):
    """A real run of the CPU engine: every fill and CPU call becomes a sample, with the bytes the
    cache counters say moved."""
    import anyio

    from freetoken.config import EngineConfig, MoeConfig, SamplingParams
    from freetoken.engine.llm import AsyncLLM

    model_dir = make_checkpoint("qwen3_moe", "tiny", seed=8)
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=128,
                          moe=MoeConfig(policy="hybrid", cache_slots=8, params={"ratio": 0.5}, cpu_threads=1))

    async def run() -> tuple[dict, dict]:
        async with AsyncLLM.start(config) as llm:
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            async for _ in llm.generate([1, 2, 3, 4], params, "r"):
                pass
            return await llm.cache_status(), llm.metrics()

    status, metrics = anyio.run(run)
    live = status["live_bandwidth"]
    assert live["pcie_fill"]["samples_total"] > 0 and live["cpu_expert"]["samples_total"] > 0
    for link in ("pcie_fill", "cpu_expert"):
        assert live[link]["estimate"]["bytes_per_s"] > 0
        assert "eager" in live[link]["source"]
    assert status["profile_bandwidth"] is None  # r is a parameter here, not the profile's
    series = {tuple(labels.values()): v for labels, v in metrics["gauges"]["expert_link_bytes_per_second"]}
    assert series[("pcie_fill", "live")] == live["pcie_fill"]["estimate"]["bytes_per_s"]
    # /metrics, read back with prometheus_client's own parser: the live gauges, no profile ones
    from prometheus_client.parser import text_string_to_metric_families

    from freetoken.server.prometheus import render_prometheus

    family = next(f for f in text_string_to_metric_families(render_prometheus(metrics))
                  if f.name == "freetoken_expert_link_bytes_per_second")
    assert family.type == "gauge"
    assert {(s.labels["link"], s.labels["figure"]) for s in family.samples} == {("pcie_fill", "live"),
                                                                               ("cpu_expert", "live")}


def _graphs_stand_in(num_layers: int, answer_ns: list[int], traced: bool = False):
    """What DecodeGraphs' sync_stats and _time_layers read, on the CPU: a real GraphPlane and
    slot cache counters, a fixed expert size, and the CPU poller's running answer time."""
    import threading
    from types import SimpleNamespace

    from freetoken.cache.slot_cache import CacheStats
    from freetoken.engine.graph_plane import GraphPlane
    from freetoken.trace import NULL_RECORDER

    plane = GraphPlane(num_layers, "cpu")
    if traced:
        plane.enable_stamps()
    runner = SimpleNamespace(slots=SimpleNamespace(stats=CacheStats.zeros(num_layers)),
                             pool=SimpleNamespace(expert_bytes=1_000))
    return SimpleNamespace(plane=plane, runner=runner, live=LiveBandwidths(), _answer_ns_folded=0,
                           _live_lock=threading.Lock(), cpu_answer_ns=lambda: answer_ns[0], trace=NULL_RECORDER,
                           device_clock=SimpleNamespace(to_host_ns=lambda ns: ns), _counts_before=None,
                           _stepping=False, last_step_end=None)


def test_graph_decode_folds_give_cpu_samples():
    """The graph path's CPU sample: the distinct CPU experts a fold brings, over the poller's
    answer time since the last fold (synthetic device counts and cycles)."""
    from freetoken.engine.decode_graphs import DecodeGraphs

    answer_ns = [0]
    graphs = _graphs_stand_in(2, answer_ns)
    misses, fetched, background = (STAT_FIELDS.index(f) for f in ("misses", "fetched", "background"))
    graphs.plane.counts[1, misses] += 6
    graphs.plane.counts[1, fetched] += 2
    graphs.plane.counts[1, background] += 1  # 6 - 2 + 1 = 5 experts on the CPU
    answer_ns[0] = 2_500
    DecodeGraphs.sync_stats(graphs)
    assert graphs.runner.slots.stats.misses == [0, 6]
    assert graphs.live.cpu_expert.estimate().bytes_per_s == pytest.approx(5 * 1_000 / 2_500e-9)
    answer_ns[0] = 3_000  # answer time with nothing folded: no sample, and not counted later
    DecodeGraphs.sync_stats(graphs)
    graphs.plane.counts[0, misses] += 1
    answer_ns[0] = 3_100
    DecodeGraphs.sync_stats(graphs)
    assert graphs.live.cpu_expert.total == 2
    assert graphs.live.cpu_expert.estimate().samples == 2  # 2 GB/s and 10 GB/s: median 6 GB/s
    assert graphs.live.cpu_expert.estimate().bytes_per_s == pytest.approx(6e9)


def test_traced_graph_steps_give_fill_samples():
    """The graph path's PCIe sample with --trace: a step's in-layer fills over their device stamps."""
    from freetoken.engine.decode_graphs import DecodeGraphs

    graphs = _graphs_stand_in(2, [0], traced=True)
    graphs._counts_before = graphs.plane.host_counts()
    graphs.plane.counts[1, STAT_FIELDS.index("fetched")] += 4
    graphs.plane.stamps[1] = torch.tensor(_stamps(10_000, 10_100, 10_500))  # layer 0: dense, no stamps
    DecodeGraphs._time_layers(graphs)
    assert graphs.live.pcie_fill.estimate().bytes_per_s == pytest.approx(4 * 1_000 / 400e-9)


def test_a_fold_from_a_mirror_older_than_the_last_fold_adds_nothing():
    """A step's counters come from its pinned mirror once it has ended, a status read while a step
    runs reads the device: a fold of an older mirror after a newer device read must neither
    subtract nor count twice."""
    from freetoken.cache.slot_cache import CacheStats
    from freetoken.engine.graph_plane import GraphPlane

    plane = GraphPlane(2, "cpu")
    stats = CacheStats.zeros(2)
    misses = STAT_FIELDS.index("misses")
    old = plane.host_counts()  # the mirror before the step
    plane.counts[1, misses] += 3  # the running step's counters, read by a status call
    assert plane.fold_into(stats)[misses] == 3
    assert plane.fold_into(stats, old) == [0] * len(STAT_FIELDS)  # older than that fold
    plane.counts[1, misses] += 2
    assert plane.fold_into(stats, plane.host_counts())[misses] == 2  # the ended step's mirror
    assert stats.misses == [0, 5]


def test_a_live_split_alone_launches_no_stamp(monkeypatch):
    """Each stamp but the fill's two is a launch in the captured step: without a trace only the
    fill's points are taken, and the fill kernel stores those itself (into `fill_stamps`, a view
    of its layer's row), so a live split's step launches none; its fill timing needs no others."""
    import freetoken.kernels.triton.device_clock as device_clock
    from freetoken.engine.graph_plane import FILL_POINTS, GraphPlane

    launched = []
    monkeypatch.setattr(device_clock, "stamp", lambda buf, index, count=1: launched.append((index, count)))
    plane = GraphPlane(2, "cpu")
    assert plane.fill_stamps(1) is None  # stamps off
    with pytest.raises(ValueError, match="unknown stamp points"):
        plane.enable_stamps(("posted", "landed"))
    plane.enable_stamps(FILL_POINTS)
    for point in ("start", "computed", "merged"):  # what a captured layer launches itself
        plane.stamp(1, point)
    plane.stamp(0, "start", "filled")  # a resident layer's one instant: not a fill
    assert launched == []
    plane.fill_stamps(1).copy_(torch.tensor([1_000, 1_400]))  # as the fill kernel stores them
    width = len(LAYER_POINTS)
    assert plane.host_stamps() == [[0] * width, [0, 1_000, 1_400, 0, 0]]
    gained = [[0] * len(STAT_FIELDS), [0, 3, 2, 0, 1, 3]]
    assert step_fill_timing(plane.host_stamps(), gained) == (2, 400)
    plane.enable_stamps()  # a trace: the fill's two still from the kernel, the others launched
    assert plane.fill_stamps(0).data_ptr() == plane.stamps[0, LAYER_POINTS.index("posted")].data_ptr()
    plane.stamp(1, "computed")
    assert launched == [(width + LAYER_POINTS.index("computed"), 1)]
