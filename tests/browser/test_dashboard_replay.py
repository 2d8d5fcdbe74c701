"""A dashboard recording replayed into a screenshot: a short run of the real engine on a tiny model
under streamed requests is recorded (benchmarks/dashboard_record.py), replayed to the packaged
page in chromium (benchmarks/dashboard_screenshot.py --replay), and the page shows the recorded
numbers: the last event's tokens, policy, slots, and live bandwidths."""

from __future__ import annotations

import json
import threading

import pytest

from benchmarks.dashboard_record import record
from benchmarks.dashboard_replay import load_recording
from benchmarks.dashboard_screenshot import replay_shot
from freetoken.config import EngineConfig, MoeConfig, ServerConfig
from freetoken.engine.llm import AsyncLLM
from tests.server_harness import running_server


@pytest.fixture(scope="module")
def recording(make_checkpoint, tmp_path_factory):
    model_dir = make_checkpoint("qwen3_moe", "tiny", seed=8)
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=256,
                          moe=MoeConfig(policy="hybrid", cache_slots=8, params={"ratio": 0.5}, cpu_threads=1),
                          served_model_name="tiny")
    out = tmp_path_factory.mktemp("recording") / "run.jsonl"
    with running_server(lambda: AsyncLLM.start(config), config=ServerConfig(host="127.0.0.1", port=0),
                        startup_timeout_s=300) as srv:
        stop = threading.Event()

        def stream() -> None:
            while not stop.is_set():
                for _ in srv.client().completions.create(model="tiny", prompt="record me", max_tokens=16,
                                                         temperature=0, stream=True, extra_body={"ignore_eos": True}):
                    pass

        workers = [threading.Thread(target=stream) for _ in range(2)]
        for worker in workers:
            worker.start()
        try:
            record(srv.url + "/dashboard", 3.0, out, poll_s=0.5, events_interval_s=0.25)
        finally:
            stop.set()
            for worker in workers:
                worker.join(60)
    return out


def test_the_recording_holds_both_endpoints_in_time_order(recording):
    lines = [json.loads(line) for line in recording.read_text().splitlines()]
    assert lines[0]["kind"] == "meta" and lines[-1]["kind"] == "end" and lines[-1]["errors"] == []
    run = load_recording(recording)
    assert len(run.snapshots) >= 3 and len(run.events) >= 6
    times = [line["t"] for line in lines[1:-1] if line["kind"] == "event"]
    assert times == sorted(times)
    first, last = run.events[0][1]["metrics"]["counters"], run.events[-1][1]["metrics"]["counters"]
    assert last["generation_tokens_total"] > first["generation_tokens_total"]  # the load is in it


def test_the_replayed_page_shows_the_recorded_numbers(recording, tmp_path):
    last = load_recording(recording).events[-1][1]
    live = last["cache"]["live_bandwidth"]
    shown = {}

    def check(page) -> None:
        for element in ("gen-tokens", "policy", "expert-slots", "bw-pcie_fill-live", "bw-cpu_expert-live",
                        "bw-cpu_expert-profile"):
            shown[element] = page.locator(f"#{element}").inner_text()

    png = tmp_path / "replay.png"
    replay_shot(recording, png, speed=20, timeout_s=60, check=check)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shown["gen-tokens"] == str(last["metrics"]["counters"]["generation_tokens_total"])
    assert shown["policy"] == "hybrid" and shown["expert-slots"] == str(last["cache"]["expert_slots"])
    for link in ("pcie_fill", "cpu_expert"):
        estimate = live[link]["estimate"]
        rate = estimate["bytes_per_s"]
        digits = 3 if rate < 1e9 else 1  # the page's own rounding
        assert shown[f"bw-{link}-live"] == f"{rate / 1e9:.{digits}f} GB/s ({estimate['samples']} samples)"
    assert shown["bw-cpu_expert-profile"].startswith("none")  # the split is a parameter here
