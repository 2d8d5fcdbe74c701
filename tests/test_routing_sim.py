"""The cache-policy simulator: `simulate`, `sweep` and the `sim` / `sim-trace` command lines."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from freetoken.sim.synthetic import SyntheticConfig, generate, write_trace
from freetoken.trace.routing import RoutingTrace, TraceError

# --------------------------------------------------------------------------- simulate


@pytest.fixture(scope="module")
def small_ids() -> np.ndarray:
    # 4 layers x 8 experts, top-2, 80 tokens: every expert seen in the first 40 tokens
    ids = generate(SyntheticConfig(4, 8, 2, 80, skew=0.3, reuse=0.3, window=2, seed=3))
    assert all(len(np.unique(ids[:40, layer])) == 8 for layer in range(4))
    return ids


def test_transfer_with_whole_pool_hits_after_warmup(small_ids: np.ndarray) -> None:
    from freetoken.sim.simulate import simulate

    r = simulate(small_ids, 4, 8, 32, "transfer", warmup_tokens=40)
    assert r.hit_rate == 1.0 and r.fetched == 0 and r.tokens == 40
    cold = simulate(small_ids, 4, 8, 32, "transfer")
    assert cold.fetched == cold.misses == 32 and cold.cpu_experts == 0
    assert cold.pcie_bytes_per_token == pytest.approx(32 * cold.expert_bytes / 80)
    assert cold.expert_bytes == 3 * 2048 * 768 * 2


def test_cpu_fetches_nothing_and_hybrid_is_between(small_ids: np.ndarray) -> None:
    from freetoken.sim.simulate import simulate

    cpu = simulate(small_ids, 4, 8, 12, "cpu")
    assert cpu.fetched == 0 and cpu.pcie_bytes_per_token == 0 and cpu.hit_rate == 0
    assert cpu.cpu_routes_per_token == 8  # 4 layers x top-2
    assert cpu.cpu_bytes_per_token == pytest.approx(8 * cpu.expert_bytes)
    transfer = simulate(small_ids, 4, 8, 12, "transfer")
    hybrid = simulate(small_ids, 4, 8, 12, "hybrid", ratio=0.5)
    assert cpu.pcie_bytes_per_token < hybrid.pcie_bytes_per_token < transfer.pcie_bytes_per_token
    assert transfer.cpu_bytes_per_token == 0 < hybrid.cpu_bytes_per_token < cpu.cpu_bytes_per_token
    assert simulate(small_ids, 4, 8, 12, "hybrid", ratio=0.0).fetched == 0
    with pytest.raises(TraceError):
        simulate(small_ids, 4, 8, 12, "hybrid", ratio=1.5)


def _drifting_routing(L: int, E: int, K: int, T: int, rate: float, seed: int) -> np.ndarray:
    """ids [T, L, K] that repeat the previous token's experts, one of them replaced for good now
    and then: a random-weight model decoding greedily routes like this."""
    rng = np.random.default_rng(seed)
    ids = np.empty((T, L, K), np.int64)
    ids[0] = [rng.choice(E, K, replace=False) for _ in range(L)]
    for t in range(1, T):
        ids[t] = ids[t - 1]
        for layer in range(L):
            new = rng.integers(E)
            if rng.random() < rate and new not in ids[t, layer]:
                ids[t, layer, rng.integers(K)] = new
    return ids


def test_hybrid_fetches_recurring_misses() -> None:
    """q*(1) = 0 below r = 1/2, so with q* alone a lone miss that recurs at every token runs on
    the CPU forever; fetching recurring misses brings hybrid's hit rate to transfer's."""
    from freetoken.sim.simulate import simulate

    ids = _drifting_routing(4, 16, 4, 400, 0.05, seed=0)
    transfer = simulate(ids, 4, 16, 32, "transfer", warmup_tokens=50)
    recurring = simulate(ids, 4, 16, 32, "hybrid", ratio=0.473, warmup_tokens=50)
    qstar_alone = simulate(ids, 4, 16, 32, "hybrid", ratio=0.473, warmup_tokens=50, fetch_recurring=False)
    assert qstar_alone.hit_rate < 0.8 < 0.95 < recurring.hit_rate <= transfer.hit_rate
    assert recurring.cpu_experts_per_token < qstar_alone.cpu_experts_per_token / 10
    assert recurring.fetched_per_token < 2 * transfer.fetched_per_token


def test_static_places_the_last_layers_on_the_gpu(small_ids: np.ndarray) -> None:
    from freetoken.sim.simulate import simulate

    r = simulate(small_ids, 4, 8, 20, "static")  # 20 // 8 = 2 whole layers
    assert r.gpu_layers == [2, 3] and r.fetched == 0
    assert r.layer_hits[:2] == [0, 0] and all(h > 0 for h in r.layer_hits[2:])
    assert all(m > 0 for m in r.layer_misses[:2]) and r.layer_misses[2:] == [0, 0]
    assert r.cpu_routes_per_token == 4  # two CPU layers x top-2
    none = simulate(small_ids, 4, 8, 7, "static")
    assert none.gpu_layers == [] and none.hit_rate == 0


def test_resident_needs_the_whole_pool(small_ids: np.ndarray) -> None:
    from freetoken.sim.simulate import simulate

    assert simulate(small_ids, 4, 8, 32, "resident").hit_rate == 1.0
    with pytest.raises(TraceError, match="resident"):
        simulate(small_ids, 4, 8, 31, "resident")
    with pytest.raises(TraceError, match="outside"):
        simulate(small_ids, 3, 8, 32, "transfer")
    with pytest.raises(TraceError, match="policy"):
        simulate(small_ids, 4, 8, 32, "lru")


def test_simulate_file_and_remap(tmp_path: Path, small_ids: np.ndarray) -> None:
    from freetoken.sim.simulate import simulate

    path = tmp_path / "s.jsonl"
    write_trace(small_ids, path)
    a = simulate(path, 4, 8, 12, "hybrid", ratio=0.3)
    b = simulate(small_ids, 4, 8, 12, "hybrid", ratio=0.3)
    assert a.to_dict() == b.to_dict()
    r = simulate(path, 8, 4, 16, "transfer", remap=True)  # 8 layers of 4 experts
    assert r.tokens == 80 and r.plans == 8 * 80


def test_sweep_writes_json_and_png(tmp_path: Path, small_ids: np.ndarray) -> None:
    from freetoken.sim.simulate import sweep

    out = sweep(small_ids, 4, 8, fractions=(0.25, 0.5, 1.0), out_prefix=tmp_path / "sw")
    doc = json.loads((tmp_path / "sw.json").read_text())
    assert doc["cache_slots"] == [8, 16, 32] and doc["pool"] == 32
    assert set(doc["policies"]) == {"resident", "transfer", "cpu", "static", "hybrid"}
    assert doc["policies"]["resident"][:2] == [None, None]
    assert doc["policies"]["resident"][2]["miss_rate"] == 0
    assert all(row["miss_rate"] == 1 for row in doc["policies"]["cpu"])
    assert doc["policies"]["static"][1]["miss_rate"] == pytest.approx(0.5)
    t = doc["policies"]["transfer"]
    assert t[0]["miss_rate"] >= t[2]["miss_rate"]
    assert out["policies"] == doc["policies"]
    from PIL import Image

    with Image.open(tmp_path / "sw.png") as png:
        assert png.format == "PNG" and png.size == (720, 440)


def _parser() -> argparse.ArgumentParser:
    from freetoken.sim.cli import add_sim_arguments, add_synth_trace_arguments, run_sim, run_synth_trace

    p = argparse.ArgumentParser()
    sub = p.add_subparsers(required=True)
    sim = sub.add_parser("sim")
    add_sim_arguments(sim)
    sim.set_defaults(run=run_sim)
    st = sub.add_parser("sim-trace")
    add_synth_trace_arguments(st)
    st.set_defaults(run=run_synth_trace)
    return p


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _parser()
    trace = tmp_path / "cli.jsonl"
    args = p.parse_args(
        [
            "sim-trace",
            "--preset",
            "olmoe",
            "--num-layers",
            "3",
            "--num-experts",
            "16",
            "--top-k",
            "4",
            "--tokens",
            "40",
            "--out",
            str(trace),
            "--stats",
        ]
    )
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert "experts covering half" in out and "reused from previous" in out
    assert len(RoutingTrace.load(trace)) == 120

    common = ["sim", "--trace", str(trace), "--num-layers", "3", "--num-experts", "16"]
    args = p.parse_args([*common, "--cache-slots", "24", "--policy", "hybrid", "--ratio", "0.4", "--json"])
    assert args.run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["policy"] == "hybrid" and doc["cache_slots"] == 24 and 0 <= doc["hit_rate"] <= 1
    assert doc["tokens"] == 40
    args = p.parse_args([*common, "--cache-slots", "24", "--policy", "hybrid", "--ratio", "0.4", "--json",
                         "--no-fetch-recurring"])
    assert args.run(args) == 0
    qstar_alone = json.loads(capsys.readouterr().out)
    from freetoken.sim.simulate import simulate

    want = simulate(str(trace), 3, 16, 24, "hybrid", ratio=0.4, fetch_recurring=False)
    assert qstar_alone["hit_rate"] == want.hit_rate and qstar_alone["misses_per_token"] == want.misses_per_token

    args = p.parse_args([*common, "--cache-slots", "24", "--policy", "static"])
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert "hit rate" in out and "PCIe per token" in out and "CPU reads per token" in out

    args = p.parse_args([*common, "--sweep", str(tmp_path / "cs"), "--fractions", "50%,1"])
    assert args.run(args) == 0
    assert (tmp_path / "cs.json").exists() and (tmp_path / "cs.png").exists()
    assert json.loads((tmp_path / "cs.json").read_text())["fetch_recurring"] is True

    args = p.parse_args([*common, "--policy", "transfer"])
    assert args.run(args) == 2
    args = p.parse_args([*common, "--cache-slots", "10", "--policy", "resident"])
    assert args.run(args) == 2
    assert "resident" in capsys.readouterr().err


def test_sweep_shares_equal_runs_and_workers_agree(small_ids: np.ndarray) -> None:
    from freetoken.sim.simulate import simulate, sweep

    fr = (0.1, 0.3, 0.6, 1.0)
    one = sweep(small_ids, 4, 8, fractions=fr, ratio=0.4)
    two = sweep(small_ids, 4, 8, fractions=fr, ratio=0.4, workers=2)
    assert one == two
    for f, s, row in zip(fr, one["cache_slots"], one["policies"]["static"], strict=True):
        assert row["fraction"] == f and row["cache_slots"] == s
        assert row["hit_rate"] == simulate(small_ids, 4, 8, s, "static").hit_rate
    for s, row in zip(one["cache_slots"], one["policies"]["hybrid"], strict=True):
        direct = simulate(small_ids, 4, 8, s, "hybrid", ratio=0.4)
        assert row["pcie_bytes_per_token"] == direct.pcie_bytes_per_token

