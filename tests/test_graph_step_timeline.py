"""Device layer spans of a traced graph step (engine/decode_graphs.py) and their analysis
(benchmarks/graph_step_timeline.py), on stamps written by hand: the emission and the sums are
plain host code, the stamps themselves come from the GPU (tests/gpu)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from benchmarks.graph_step_timeline import main as timeline_main
from benchmarks.graph_step_timeline import summarise
from freetoken.cache.live_bandwidth import LiveBandwidths
from freetoken.engine.decode_graphs import DecodeGraphs
from freetoken.engine.graph_plane import LAYER_POINTS
from freetoken.kernels.triton.device_clock import DeviceClock
from freetoken.trace import TraceRecorder

US = 1000  # ns
EXPERT_BYTES = 4096


def traced_step(rec, stamps_us, gained, offset_ns=5_000_000, live=None):
    """Run DecodeGraphs._time_layers on a stand-in holding these stamps (us, device clock) and
    per-layer counter gains [hits, misses, fetched, background, cpu_routes, routed]."""
    stamps = (torch.tensor(stamps_us, dtype=torch.int64) * US).tolist()
    # the step's pinned mirror: these stamps, and counters that started from zero
    plane = SimpleNamespace(stamps=stamps, host_stamps=lambda: stamps, host_counts=lambda: gained)
    runner = SimpleNamespace(pool=SimpleNamespace(expert_bytes=EXPERT_BYTES))
    fake = SimpleNamespace(device_clock=DeviceClock(offset_ns, 0), plane=plane, trace=rec,
                           _counts_before=None, runner=runner, live=live or LiveBandwidths())
    DecodeGraphs._time_layers(fake)


def test_layer_phases_become_spans_and_the_summary_adds_them_up(tmp_path):
    assert len(LAYER_POINTS) == 5
    rec = TraceRecorder()
    # layer 0: dense (never stamped); layer 1: one fetch; layer 2: two CPU routes and a wait.
    stamps = [[0, 0, 0, 0, 0], [100, 110, 310, 340, 345], [445, 455, 455, 480, 700]]
    gained = [[0] * 6, [7, 1, 1, 0, 0, 8], [6, 2, 0, 0, 2, 8]]
    live = LiveBandwidths()
    traced_step(rec, stamps, gained, live=live)
    # the step's one in-layer fill, posted to filled in 200 us, is the live PCIe sample
    assert live.pcie_fill.estimate().bytes_per_s == EXPERT_BYTES * 1e9 / (200 * US)
    assert live.cpu_expert.total == 0
    rec.complete("pcie_mover", "fill", 0, 10 * US, experts=3)  # a host-side span of the same name
    # the CPU's doorbell span of layer 2: saw the ring 8 us after the bell, answered 150 us later
    rec.complete("cpu_executor", "doorbell_cpu_moe", 5_000_000 + 463 * US, 5_000_000 + 613 * US, layer=2)
    rec.complete("gpu_runner", "graph_step", 5_000_000 + 90 * US, 5_000_000 + 720 * US, batch=1)
    doc = rec.to_chrome()
    fills = [e for e in doc["traceEvents"] if e.get("name") == "fill" and "layer" in e.get("args", {})]
    assert [(f["args"]["layer"], f["args"]["fetched"], f["dur"]) for f in fills] == [(1, 1, 200.0), (2, 0, 0.0)]
    s = summarise(doc)
    assert s["steps"] == 1 and s["step_us"] == 630.0
    assert s["phase_us_per_step"] == {"plan_post": 20.0, "fill": 200.0, "gemm": 55.0, "wait_cpu": 225.0,
                                      "between_layers": 100.0}
    assert s["fetched_per_step"] == 1 and s["cpu_routes_per_step"] == 2
    cpu_layer = next(g for g in s["by_layer_work_us"] if g["cpu_routes"] == 2)
    assert (cpu_layer["bell_to_cpu"], cpu_layer["cpu"], cpu_layer["answer_to_device"]) == (8.0, 150.0, 87.0)
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(doc))
    out = tmp_path / "summary.json"
    assert timeline_main([f"hybrid={trace}", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["runs"]["hybrid"]["fetched_per_step"] == 1


def test_a_trace_without_device_spans_is_refused(tmp_path, capsys):
    rec = TraceRecorder()
    rec.complete("gpu_runner", "graph_step", 0, 1000, batch=1)
    trace = tmp_path / "t.json"
    rec.write_perfetto(trace)
    assert timeline_main([f"eager={trace}"]) == 1
    assert "no device layer spans" in capsys.readouterr().err


def test_cpu_hand_offs_split_by_whether_a_background_fill_was_streaming_in():
    """Layer 1 computes its lone miss on the CPU and fills it in the background; layer 2's CPU
    hand-off starts 60 us after layer 1 ended, inside the fill's 190 us of link: 'streaming'."""
    rec = TraceRecorder()
    stamps = [[0, 0, 0, 0, 0], [100, 110, 115, 140, 300], [350, 360, 360, 380, 450]]
    gained = [[0] * 6, [7, 1, 1, 1, 1, 8], [7, 1, 0, 0, 1, 8]]
    traced_step(rec, stamps, gained)
    for layer, seen, answered in ((1, 112, 280), (2, 362, 420)):
        rec.complete("cpu_executor", "doorbell_cpu_moe", 5_000_000 + seen * US, 5_000_000 + answered * US, layer=layer)
    s = summarise(rec.to_chrome())
    assert s["cpu_answer_to_device_us"] == {"link_quiet": {"rings": 1, "median_us": 20.0},
                                            "fill_streaming": {"rings": 1, "median_us": 30.0}}
    quiet = summarise(rec.to_chrome(), fill_us=40.0)["cpu_answer_to_device_us"]  # the fill is over by then
    assert quiet["link_quiet"]["rings"] == 2 and quiet["fill_streaming"]["rings"] == 0
