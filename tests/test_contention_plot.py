"""benchmarks/contention_plot.py: a contention run's JSON as grouped tok/s bars and the live split's r."""

from __future__ import annotations

import json

from benchmarks.contention_plot import main, split_series, tok_per_s_by_load


def _report() -> dict:
    decode = [
        {"part": "decode", "policy": "hybrid:adaptive=true", "load": "quiet", "tok_per_s": 140.0,
         "split_trace": [[1, 0.5], [2, 0.55]]},
        {"part": "decode", "policy": "transfer", "load": "quiet", "tok_per_s": 100.0},
        {"part": "decode", "policy": "hybrid:adaptive=true", "load": "copy", "tok_per_s": 90.0,
         "split_trace": [[3, 0.45], [4, 0.4]]},
        {"part": "decode", "policy": "transfer", "load": "copy", "tok_per_s": 80.0},
        {"part": "decode", "policy": "cpu,auto", "failed": "timeout: killed after 300 s"},  # a cut child: no load
    ]
    return {"records": [{"part": "decode-start", "policy": "transfer", "seconds": 3.0}, *decode]}


def test_bars_group_by_load_and_the_split_breaks_between_loads(tmp_path):
    report = _report()
    assert tok_per_s_by_load(report) == {"quiet": {"hybrid:adaptive=true": 140.0, "transfer": 100.0},
                                         "copy": {"hybrid:adaptive=true": 90.0, "transfer": 80.0}}
    assert split_series(report) == {"hybrid:adaptive=true": [(1.0, 0.5), (2.0, 0.55), None, (3.0, 0.45), (4.0, 0.4)]}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(report))
    assert main([str(path)]) == 0
    for suffix in ("tok-s", "split"):
        assert (tmp_path / f"run-{suffix}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_without_decode_records_is_refused(tmp_path, capsys):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"records": [{"part": "demo", "tok_per_s": 10.0}]}))
    assert main([str(path)]) == 2
    assert "no decode records" in capsys.readouterr().err
