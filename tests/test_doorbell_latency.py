"""benchmarks/doorbell_latency.py on CPU: the ringer thread, both pollers, the results file."""

from __future__ import annotations

import json

from benchmarks.doorbell_latency import main


def test_doorbell_latency_times_both_pollers(tmp_path):
    out = tmp_path / "latency.json"
    assert main(["--pool", "12", "--calls", "8", "--experts", "0,1", "--gaps-us", "20", "--threads", "1",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["poller"], r["experts"]) for r in rows] == [("team", 0), ("team", 1), ("per-call", 0), ("per-call", 1)]
    for r in rows:
        assert r["median_us"] > 0 and r["p90_us"] >= r["median_us"]
        assert r["median_us"] >= r["kernel_span_median_us"] > 0  # the ring contains the poller's span
    one = {r["poller"]: r for r in rows if r["experts"] == 1}
    empty = {r["poller"]: r for r in rows if r["experts"] == 0}
    assert all(one[p]["kernel_span_median_us"] > empty[p]["kernel_span_median_us"] for p in one)
