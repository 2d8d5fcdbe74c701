"""benchmarks/layer_serial_floor.py on a committed H200 run and the routing it replayed."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.layer_serial_floor import main

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_layer_serial_floor_matches_the_bench_and_bounds_it(tmp_path):
    out = tmp_path / "floor.json"
    assert main(["--bench", str(RESULTS / "decode-own-routing-fixed-team-h200.json"),
                 "--trace", str(RESULTS / "own-routing-resident-h200.jsonl"),
                 "--num-layers", "16", "--num-experts", "128", "--out", str(out)]) == 0
    bench = {r["policy"]: r for r in json.loads((RESULTS / "decode-own-routing-fixed-team-h200.json").read_text())
             ["results"]}
    rows = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"transfer", "hybrid"}
    for policy, r in rows.items():
        assert abs(r["sim_hit_rate"] - bench[policy]["hit_rate"]) < 1e-9  # the engine's plans, replayed
        assert abs(r["floor_ms"] - bench[policy]["floor_ms_per_token"]) < 1e-6 * r["floor_ms"]  # the bench's floor
        assert r["layer_serial_floor_ms"] >= r["floor_ms"] * (1 - 1e-9)
    transfer = rows["transfer"]  # one path only: the order of the layers changes nothing
    assert abs(transfer["layer_serial_floor_ms"] - transfer["floor_ms"]) < 1e-9 * transfer["floor_ms"]
    assert rows["hybrid"]["layer_serial_floor_ms"] > 1.05 * rows["hybrid"]["floor_ms"]
