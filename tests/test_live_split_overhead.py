"""The live split's lab comparison (benchmarks/live_split_overhead.py) on the CPU: each variant is
what it says (the thread search fed or not, the share applied or not), and the report is written
after every record."""

from __future__ import annotations

import json
import sys

from benchmarks import live_split_overhead
from freetoken.moe.bandwidth_profile import DEFAULT_CPU_BPS, DEFAULT_PCIE_BPS
from freetoken.reference.expert_cache import pcie_share, share_q16


def test_each_variant_switches_off_what_it_names_and_the_report_follows_every_record(make_checkpoint, tmp_path,
                                                                                     monkeypatch):
    model_dir = make_checkpoint("qwen3_moe", "tiny", seed=8)
    out = tmp_path / "overhead.json"
    written = []
    original = live_split_overhead._write

    def write(path, commit, records):
        written.append(len(records))
        return original(path, commit, records)

    monkeypatch.setattr(live_split_overhead, "_write", write)
    monkeypatch.setattr(sys, "argv", ["live_split_overhead", "--model", str(model_dir), "--moe-cache-slots", "8",
                                      "--bw-profile", str(tmp_path / "none.json"), "--prompt-tokens", "4",
                                      "--warmup-tokens", "2", "--steps", "12", "--repeats", "1", "--out", str(out)])
    assert live_split_overhead.main() == 0
    report = json.loads(out.read_text())
    records = {r["variant"]: r for r in report["records"]}
    assert written == [1, 2, 3, 4, 4] and set(records) == set(live_split_overhead.VARIANTS)
    assert all(r["steps"] == len(r["step_ms"]) == 12 for r in records.values())
    assert "split" not in records["static"] and "cpu_threads" not in records["static"]
    assert records["live"]["cpu_threads"]["steps"] == 14  # fed every decode step (warm-up included)
    assert records["live-threads-fixed"]["cpu_threads"]["steps"] == 0  # not fed
    live, prior = records["live"], records["live-measure-only"]
    assert live["planner_ratio_q16"] == share_q16(live["split"]["ratio"])  # the planner follows the split
    assert prior["cpu_threads"]["steps"] == 0
    # the split moved its estimate, but the planner kept the profile's share
    profile_share = share_q16(pcie_share(DEFAULT_PCIE_BPS, DEFAULT_CPU_BPS))  # (no profile file: the defaults)
    assert prior["planner_ratio_q16"] == profile_share != share_q16(prior["split"]["ratio"])
    assert set(report["summary"]) == {f"quiet/{v}" for v in live_split_overhead.VARIANTS}
