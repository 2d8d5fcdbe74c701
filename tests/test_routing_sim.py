"""Routing traces (record, load, replay), the synthetic generator, and the cache-policy simulator."""

from __future__ import annotations

import argparse
import json
import struct
import threading
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from freetoken.sim.synthetic import (
    MIXTRAL_REUSE_SHARE,
    OLMOE_HALF_COVER,
    SyntheticConfig,
    calibrated,
    generate,
    trace_stats,
    write_trace,
)
from freetoken.trace.routing import RoutingRecorder, RoutingReplay, RoutingTrace, TraceError

# --------------------------------------------------------------------------- record / load


def _write_simple(path: Path, layers: int = 2, tokens: int = 3) -> None:
    with RoutingRecorder(path, flush_lines=2) as rec:
        rec.record("p", 0, 0, "prefill", [[1, 2], [3, 4]], [[0.6, 0.4], [0.5, 0.5]])
        for t in range(tokens):
            for layer in range(layers):
                rec.record("p", t + 1, layer, "decode", [[np.int64(t), t + 5]], [[np.float32(0.75), 0.25]])


def test_recorder_loader_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    _write_simple(path)
    trace = RoutingTrace.load(path)
    assert len(trace) == 7
    first = trace.records[0]
    assert (first.request, first.step, first.layer, first.phase) == ("p", 0, 0, "prefill")
    assert first.experts == [[1, 2], [3, 4]] and first.weights == [[0.6, 0.4], [0.5, 0.5]]
    assert trace.records[-1].experts == [[2, 7]] and trace.records[-1].weights == [[0.75, 0.25]]
    assert (trace.num_layers, trace.num_experts, trace.top_k) == (2, 8, 2)
    assert trace.tokens_by_layer()[0] == [[1, 2], [3, 4], [0, 5], [1, 6], [2, 7]]
    for line in path.read_text().splitlines():
        assert set(json.loads(line)) == {"request", "step", "layer", "phase", "experts", "weights"}


def test_recorder_is_thread_safe_and_rejects_bad_records(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rec = RoutingRecorder(path, flush_lines=7)

    def work(i: int) -> None:
        for s in range(50):
            rec.record(f"r{i}", s, i % 3, "decode", [[i, i + 1, i + 2]], [[0.5, 0.3, 0.2]])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with pytest.raises(TraceError, match="repeated"):
        rec.record("x", 0, 0, "decode", [[1, 1]], [[0.5, 0.5]])
    with pytest.raises(TraceError, match="weights"):
        rec.record("x", 0, 0, "decode", [[1, 2]], [[0.5]])
    rec.close()
    rec.close()
    with pytest.raises(TraceError, match="closed"):
        rec.record("x", 0, 0, "decode", [[1]], [[1.0]])
    trace = RoutingTrace.load(path)
    assert len(trace) == 400
    for i in range(8):
        assert [r.step for r in trace if r.request == f"r{i}"] == list(range(50))


_GOOD = {"request": "r", "step": 0, "layer": 0, "phase": "decode", "experts": [[1]], "weights": [[1.0]]}


def _line(**changes: object) -> str:
    rec = {**_GOOD, **changes}
    return json.dumps({k: v for k, v in rec.items() if v is not None})


@pytest.mark.parametrize(
    "bad, match",
    [
        ("{not json", "line 3"),
        (_line(step="x"), r"line 3.*step"),
        (_line(phase="train"), r"line 3.*phase"),
        (_line(experts=[[1, 2]]), r"line 3.*weights"),
        (_line(experts=[[1, 1]], weights=[[1, 1]]), r"line 3.*repeated"),
        (_line(layer=-1), r"line 3.*layer"),
        (_line(weights=None), r"line 3.*weights"),
        (_line(experts=[[]], weights=[[]]), r"line 3.*no experts"),
    ],
)
def test_bad_line_names_its_number(tmp_path: Path, bad: str, match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{_line()}\n\n{bad}\n{_line()}\n")  # blank lines are skipped but counted
    with pytest.raises(TraceError, match=match) as info:
        RoutingTrace.load(path)
    assert str(path) in str(info.value)


def test_missing_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        RoutingTrace.load(tmp_path / "absent.jsonl")


# --------------------------------------------------------------------------- replay


def _trace(tmp_path: Path, layers: int, experts: int, k: int, tokens: int, seed: int = 0) -> RoutingTrace:
    ids = generate(SyntheticConfig(layers, experts, k, tokens, skew=0.8, reuse=0.3, window=2, seed=seed))
    path = tmp_path / f"tr-{layers}-{experts}-{k}-{tokens}-{seed}.jsonl"
    write_trace(ids, path)
    return RoutingTrace.load(path)


def _valid(rows: list[list[int]], n: int, k: int, experts: int) -> None:
    assert len(rows) == n
    for row in rows:
        assert len(row) == k and len(set(row)) == k
        assert all(0 <= e < experts for e in row)


def test_replay_same_shape_is_identity_and_wraps(tmp_path: Path) -> None:
    trace = _trace(tmp_path, 4, 16, 4, 10)
    by_layer = trace.tokens_by_layer()
    rp = RoutingReplay(trace, 4, 16)
    assert rp.layer_map == [0, 1, 2, 3]
    assert rp.ids_for(2, 6, 4) == by_layer[2][:6]
    assert rp.ids_for(2, 6, 4) == by_layer[2][6:] + by_layer[2][:2]  # wraps around
    assert rp.ids_for(0, 1, 4) == by_layer[0][:1]  # cursors are per layer
    rp.reset()
    assert rp.ids_for(2, 1, 4) == by_layer[2][:1]


def test_replay_layer_mapping(tmp_path: Path) -> None:
    trace = _trace(tmp_path, 4, 16, 4, 5)
    assert RoutingReplay(trace, 8, 16).layer_map == [0, 0, 1, 1, 2, 2, 3, 3]
    assert RoutingReplay(trace, 2, 16).layer_map == [0, 2]
    assert RoutingReplay(trace, 6, 16).layer_map == [0, 0, 1, 2, 2, 3]
    # a trace that kept only some layers: the nearest traced layer (lower on ties)
    sparse = RoutingTrace([r for r in trace if r.layer in (0, 3)])
    assert RoutingReplay(sparse, 4, 16).layer_map == [0, 0, 3, 3]
    assert RoutingReplay(sparse, 8, 16).layer_map == [0, 0, 0, 0, 3, 3, 3, 3]


@pytest.mark.parametrize("experts, k", [(16, 4), (8, 4), (5, 3), (64, 4), (16, 2), (16, 7), (40, 12)])
def test_replay_rows_are_distinct_in_range_and_deterministic(tmp_path: Path, experts: int, k: int) -> None:
    trace = _trace(tmp_path, 3, 16, 4, 20)
    a = RoutingReplay(trace, 5, experts)
    b = RoutingReplay(trace, 5, experts)
    for layer in range(5):
        rows = a.ids_for(layer, 27, k)
        _valid(rows, 27, k, experts)
        assert rows == b.ids_for(layer, 27, k)


def test_replay_expert_mapping_rules(tmp_path: Path) -> None:
    trace = _trace(tmp_path, 2, 16, 4, 30)
    src = trace.tokens_by_layer()[1]
    # fewer model experts: modulo
    rows = RoutingReplay(trace, 2, 8).ids_for(1, 30, 2)
    for got, orig in zip(rows, src, strict=True):
        mapped = list(dict.fromkeys(e % 8 for e in orig))
        assert got == mapped[:2]
    # more model experts: a fixed injective permutation per layer, keeps the trace's pattern
    rp = RoutingReplay(trace, 2, 64)
    rows = rp.ids_for(1, 30, 4)
    assert rows == [[rp.map_expert(1, e) for e in orig] for orig in src]
    perm = [rp.map_expert(1, e) for e in range(16)]
    assert len(set(perm)) == 16 and perm != list(range(16))
    # narrower model top-k keeps the first ids, wider pads with distinct extras
    rows = RoutingReplay(trace, 2, 16).ids_for(1, 30, 6)
    for got, orig in zip(rows, src, strict=True):
        assert got[:4] == orig and len(set(got)) == 6


def test_replay_errors(tmp_path: Path) -> None:
    trace = _trace(tmp_path, 2, 16, 4, 5)
    rp = RoutingReplay(trace, 2, 16)
    with pytest.raises(TraceError):
        rp.ids_for(2, 1, 4)
    with pytest.raises(TraceError):
        rp.ids_for(0, 1, 17)
    with pytest.raises(TraceError, match="no records"):
        RoutingReplay(RoutingTrace([]), 2, 16)


# --------------------------------------------------------------------------- synthetic


def test_generator_is_deterministic_and_rows_distinct() -> None:
    cfg = SyntheticConfig(3, 16, 4, 200, skew=1.0, reuse=0.5, window=3, seed=7)
    a, b = generate(cfg), generate(cfg)
    assert a.shape == (200, 3, 4) and np.array_equal(a, b)
    assert not np.array_equal(a, generate(replace(cfg, seed=8)))
    assert all(len(set(row)) == 4 for row in a.reshape(-1, 4).tolist())
    assert a.min() >= 0 and a.max() < 16
    # hot experts differ between layers
    hottest = [np.bincount(a[:, layer].ravel(), minlength=16).argmax() for layer in range(3)]
    assert len(set(hottest)) > 1
    with pytest.raises(TraceError):
        generate(replace(cfg, top_k=17))


def test_generator_knobs_move_the_statistics() -> None:
    base = SyntheticConfig(4, 32, 4, 1500, seed=1)
    flat, skewed = trace_stats(generate(base)), trace_stats(generate(replace(base, skew=1.2)))
    assert skewed["half_cover"] < flat["half_cover"]
    assert skewed["entropy_bits"] < flat["entropy_bits"]
    assert skewed["top_expert_share"] > flat["top_expert_share"]
    # no reuse at no skew: the uniform baseline
    for w, v in flat["reuse"].items():
        assert v == pytest.approx(flat["uniform_reuse"][w], abs=0.02)
    low = trace_stats(generate(replace(base, skew=0.5, reuse=0.1)))
    high = trace_stats(generate(replace(base, skew=0.5, reuse=0.6)))
    assert high["reuse"][1] > low["reuse"][1] + 0.15
    # a longer window spreads reuse over older tokens
    w1 = trace_stats(generate(replace(base, reuse=0.5, window=1)))
    w8 = trace_stats(generate(replace(base, reuse=0.5, window=8)))
    assert w1["reuse"][1] > w8["reuse"][1]


def test_calibrated_presets_hit_their_targets() -> None:
    olmoe = calibrated("olmoe", num_tokens=1500)
    assert (olmoe.num_layers, olmoe.num_experts, olmoe.top_k) == (16, 64, 8)
    s = trace_stats(generate(olmoe))
    assert abs(s["half_cover"] - OLMOE_HALF_COVER) <= 1.5
    assert 5.3 < s["entropy_bits"] < 5.9  # OLMoE's own mean: 5.55
    # the fitted share scales with the expert count
    big = trace_stats(generate(calibrated("olmoe", num_layers=4, num_experts=128, num_tokens=800)))
    assert big["half_cover_fraction"] == pytest.approx(OLMOE_HALF_COVER / 64, abs=0.03)

    mix = trace_stats(generate(calibrated("mixtral", num_layers=8, num_tokens=2500)))
    assert mix["reuse"][1] == pytest.approx(MIXTRAL_REUSE_SHARE[1], abs=0.02)
    for w in (2, 4, 8):
        assert mix["reuse"][w] == pytest.approx(MIXTRAL_REUSE_SHARE[w], abs=0.05)
    assert mix["half_cover"] == 4 and mix["entropy_bits"] > 2.95

    uni = calibrated("uniform", num_layers=2, num_experts=8, top_k=2, num_tokens=10)
    assert (uni.skew, uni.reuse) == (0.0, 0.0)
    assert calibrated("mixtral", reuse=0.5).reuse == 0.5
    with pytest.raises(TraceError):
        calibrated("gpt")


def test_trace_stats_from_file_match_array(tmp_path: Path) -> None:
    ids = generate(calibrated("mixtral", num_layers=3, num_tokens=60))
    path = tmp_path / "m.jsonl"
    write_trace(ids, path)
    from_file = trace_stats(path, num_experts=8)
    from_ids = trace_stats(ids)
    assert from_file == from_ids
    rec = RoutingTrace.load(path).records[5]
    assert (rec.request, rec.phase, rec.step, rec.layer) == ("synthetic", "decode", 1, 2)


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


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height, depth, color = struct.unpack(">IIBB", data[16:26])
    assert (depth, color) == (8, 2)
    assert zlib.crc32(data[12:29]) & 0xFFFFFFFF == struct.unpack(">I", data[29:33])[0]
    return width, height


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
    data = (tmp_path / "sw.png").read_bytes()
    assert _png_size(data) == (720, 440)
    # the image data decodes to one filter byte + RGB per row
    idat = data.index(b"IDAT")
    (n,) = struct.unpack(">I", data[idat - 4 : idat])
    assert len(zlib.decompress(data[idat + 4 : idat + 4 + n])) == 440 * (1 + 720 * 3)


def test_encode_png_small() -> None:
    from freetoken.sim.png_plot import encode_png

    data = encode_png(3, 2, bytes(range(18)))
    assert _png_size(data) == (3, 2) and data.endswith(b"IEND\xaeB`\x82")
    with pytest.raises(ValueError):
        encode_png(3, 2, b"\x00")


# --------------------------------------------------------------------------- command lines


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

