"""The trace recorder and its Chrome Trace Event (Perfetto) output."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from freetoken.trace import NULL_RECORDER, TraceRecorder


def _tracks(doc: dict) -> dict[int, str]:
    events = doc["traceEvents"]
    return {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}


def test_written_trace_is_well_formed(tmp_path: Path) -> None:
    rec = TraceRecorder()
    with rec.span("scheduler", "step", batch=4):
        rec.instant("scheduler", "admit", request="r1")
        rec.counter("scheduler", "running", 4)
    handle = rec.begin("pcie", "copy", layer=3)
    worker = threading.Thread(target=rec.end, args=(handle,), kwargs={"bytes": 1 << 20})
    worker.start()
    worker.join()
    with pytest.raises(ValueError), rec.span("gpu_runner", "decode"):
        raise ValueError("fault")

    path = tmp_path / "trace.json"
    rec.write_perfetto(path)
    doc = json.loads(path.read_text())

    assert doc["displayTimeUnit"] == "ms"
    events = doc["traceEvents"]
    tracks = _tracks(doc)
    assert sorted(tracks.values()) == ["gpu_runner", "pcie", "scheduler"]
    assert len(set(tracks)) == 3  # one thread id per track
    assert {e["pid"] for e in events} == {1}
    spans = [e for e in events if e["ph"] == "X"]
    for e in spans:
        assert e["tid"] in tracks
        assert isinstance(e["ts"], float) and e["ts"] >= 0 and e["dur"] >= 0
    by_name = {e["name"]: e for e in spans}
    assert set(by_name) == {"step", "copy", "decode"}
    assert by_name["step"]["args"] == {"batch": 4}
    assert by_name["copy"]["args"] == {"layer": 3, "bytes": 1 << 20}  # ended on another thread
    assert by_name["decode"]["args"] == {"error": "ValueError"}
    assert tracks[by_name["copy"]["tid"]] == "pcie"
    (counter,) = [e for e in events if e["ph"] == "C"]
    assert counter["name"] == "scheduler/running" and counter["args"] == {"value": 4}
    (instant,) = [e for e in events if e["ph"] == "i"]
    assert instant["s"] == "t" and tracks[instant["tid"]] == "scheduler"
    # The instant and counter fall inside the step span on the timeline.
    step = by_name["step"]
    assert step["ts"] <= instant["ts"] <= counter["ts"] <= step["ts"] + step["dur"]


def test_disabled_recorder_records_nothing(tmp_path: Path) -> None:
    for rec in (TraceRecorder(enabled=False), NULL_RECORDER):
        with rec.span("a", "x", k=1) as span:
            pass
        assert span is rec.span("b", "y")  # one shared no-op object, no allocation per call
        rec.end(rec.begin("a", "y"))
        rec.counter("a", "c", 1)
        rec.instant("a", "i")
        assert [e for e in rec.to_chrome()["traceEvents"] if e["ph"] != "M"] == []


def test_threads_record_concurrently() -> None:
    rec = TraceRecorder()
    threads = 4
    per_thread = 1000

    def work(track: str) -> None:
        for i in range(per_thread):
            with rec.span(track, "expert", i=i):
                pass

    pool = [threading.Thread(target=work, args=(f"cpu{t}",)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    doc = rec.to_chrome()
    tracks = _tracks(doc)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == threads * per_thread
    for t in range(threads):
        mine = [e["args"]["i"] for e in spans if tracks[e["tid"]] == f"cpu{t}"]
        assert sorted(mine) == list(range(per_thread))
