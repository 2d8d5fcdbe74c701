"""Routing traces (record, load, replay) and the synthetic generator."""

from __future__ import annotations

import json
import threading
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


@pytest.mark.parametrize("experts, k", [(8, 3), (16, 6), (64, 4), (5, 5)])
def test_replay_rows_follow_the_rules_position_by_position(tmp_path: Path, experts: int, k: int) -> None:
    """Rows drawn in uneven steps, across wrap-around, equal the mapping rules restated per
    position: the row at pos % T mapped expert by expert, duplicates dropped, the first k kept,
    and short rows padded from the hash of (layer, pos) on (the rows are mapped once per layer
    and looked up, so this pins what the lookup must keep)."""
    from freetoken.trace.routing import _mix

    trace = _trace(tmp_path, 2, 16, 4, 9)
    src = trace.tokens_by_layer()
    rp = RoutingReplay(trace, 3, experts)

    def expected(layer: int, pos: int) -> list[int]:
        rows = src[rp.layer_map[layer]]
        row = list(dict.fromkeys(rp.map_expert(layer, e) for e in rows[pos % len(rows)]))[:k]
        c = _mix((layer << 40) ^ pos) % experts
        while len(row) < k:
            if c not in row:
                row.append(c)
            c = (c + 1) % experts
        return row

    for layer in range(3):
        pos = 0
        for n in (1, 4, 7, 2, 11):  # 25 rows of a 9-row trace layer
            assert rp.ids_for(layer, n, k) == [expected(layer, p) for p in range(pos, pos + n)]
            pos += n


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
