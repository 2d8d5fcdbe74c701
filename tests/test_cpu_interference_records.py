"""The contention benchmark keeps what a child measured before it was killed: its records arrive
as printed, not when the child ends (a device run cut by its time limit used to keep nothing)."""

from __future__ import annotations

import os
import sys
import time

from benchmarks.child_records import json_line_records

CHILD = """import json, sys, time
for i in range(int(sys.argv[1])):
    print(json.dumps({"part": "decode", "load": f"load{i}"}), flush=True)
print("not a record", flush=True)
if sys.argv[2] == "hang":
    time.sleep(600)
sys.exit(int(sys.argv[3]))
"""


def run_child(records: int, end: str, code: int = 0, timeout: float = 30.0) -> tuple[list[dict], list[dict]]:
    seen: list[dict] = []
    out = json_line_records([sys.executable, "-c", CHILD, str(records), end, str(code)], timeout, dict(os.environ),
                            seen.append, failed_record={"part": "decode", "policy": "hybrid"})
    return out, seen


def test_a_childs_records_arrive_in_order_and_nothing_else_is_added():
    out, seen = run_child(3, "exit")
    assert out == seen == [{"part": "decode", "load": f"load{i}"} for i in range(3)]


def test_a_killed_child_keeps_what_it_printed_before_and_says_it_was_killed():
    started = time.monotonic()
    out, seen = run_child(2, "hang", timeout=3.0)
    assert time.monotonic() - started < 60  # killed at its timeout, not waited for
    assert out == seen
    assert [r.get("load") for r in out[:2]] == ["load0", "load1"]
    assert out[2]["policy"] == "hybrid" and out[2]["failed"].startswith("timeout: killed after 3.0 s")


def test_a_failing_child_is_reported_with_its_exit_code():
    out, _ = run_child(1, "exit", code=3)
    assert out[0] == {"part": "decode", "load": "load0"}
    assert out[1]["failed"].startswith("exit 3")


def test_the_contention_run_reports_every_policy_and_load_on_cpu(make_checkpoint, tmp_path):
    """The whole script on the CPU (eager decode, no copy load): the live split's record carries its
    r; auto's loads start after its first probe."""
    import json
    import subprocess

    from benchmarks.child_records import CHILD_CWD

    model, out = make_checkpoint("qwen3_moe"), tmp_path / "contention.json"
    subprocess.run([sys.executable, "-m", "benchmarks.cpu_interference", "--model", str(model),
                    "--moe-cache-slots", "8", "--policies", "hybrid:adaptive=true,cpu,auto", "--loads", "quiet,busy1",
                    "--one-process", "--no-pool", "--warmup-tokens", "2", "--decode-tokens", "3", "--out", str(out)],
                   cwd=CHILD_CWD, check=True, capture_output=True, timeout=300)
    records = json.loads(out.read_text())["records"]
    decode = [r for r in records if r["part"] == "decode"]
    assert [(r["policy"], r["load"]) for r in decode] == [
        ("hybrid:adaptive=true", "quiet"), ("hybrid:adaptive=true", "busy1"), ("cpu", "quiet"), ("cpu", "busy1"),
        ("auto", "quiet"), ("auto", "busy1")]
    assert all(r["tokens"] == 3 and not r["frozen"] for r in decode)
    assert "split_trace" in decode[0] and "split_trace" not in decode[2]
    start = next(r for r in records if r["part"] == "decode-start" and r["policy"] == "auto")
    # the defaults' warm-up and probe, less the 2 warm-up tokens before, and one step more: a
    # step is folded into the choice when the next one starts
    first_probe = 32 + 3 * 7 - 2 + 1
    assert start["first_probe_steps"] == first_probe and decode[4]["live_policy"]["probes"] >= 1


def test_targets_leave_out_a_policy_that_never_ran_and_count_one_that_failed():
    from benchmarks.cpu_interference import _targets

    def decode(policy, load, rate=None):
        return {"part": "decode", "policy": policy, "load": load, **({} if rate is None else {"tok_per_s": rate})}

    runs = [decode("transfer", "copy", 80.0), decode("hybrid:adaptive=false", "copy", 100.0)]
    assert "hybrid_over_transfer_copy" not in _targets(runs)  # plain `hybrid` was not run
    frozen = _targets([*runs, decode("hybrid", "copy")])  # it ran and left no rate: a failure, not a gap
    assert frozen["hybrid_over_transfer_copy"] == {"ratio": 0.0, "target": ">= 1", "met": False}
    assert _targets([*runs, decode("hybrid", "copy", 96.0)])["hybrid_over_transfer_copy"]["met"]
