"""The Prometheus renderer on its own: every exposition is read back with prometheus_client's parser."""

from __future__ import annotations

import math

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from freetoken.server.prometheus import render_prometheus


def parse_exposition(text: str) -> dict[str, Metric]:
    """{family name: family} as Prometheus's own parser reads the text (a counter's family drops `_total`)."""
    assert text == "" or text.endswith("\n")
    families = {}
    for family in text_string_to_metric_families(text):
        assert family.name not in families, f"two families named {family.name}"
        families[family.name] = family
    return families


def _samples(families: dict[str, Metric]) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}


def check_histogram(family: Metric) -> None:
    series: dict[tuple, dict] = {}
    for s in family.samples:
        key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
        entry = series.setdefault(key, {"buckets": []})
        suffix = s.name[len(family.name) + 1 :]
        if suffix == "bucket":
            entry["buckets"].append((float(s.labels["le"]), s.value))
        else:
            entry[suffix] = s.value
    assert series, f"histogram {family.name} has no samples"
    for entry in series.values():
        les = [le for le, _ in entry["buckets"]]
        counts = [n for _, n in entry["buckets"]]
        assert les == sorted(les) and les[-1] == math.inf, les
        assert counts == sorted(counts), f"{family.name} buckets are not cumulative: {counts}"
        assert counts[-1] == entry["count"]
        assert "sum" in entry


def test_render_counters_gauges_and_help():
    text = render_prometheus(
        {
            "counters": {"requests_total": 3, "freetoken_pcie_bytes_total": 1 << 40},
            "gauges": {"expert_cache_hit_rate": 0.5, "decode_tokens_per_second": None, "odd-name.x": math.inf},
            "help": {"requests_total": 'All of them,\nwith a back\\slash and "quotes"'},
        }
    )
    families = parse_exposition(text)
    assert {name: f.type for name, f in families.items()} == {
        "freetoken_requests": "counter",
        "freetoken_pcie_bytes": "counter",
        "freetoken_expert_cache_hit_rate": "gauge",
        "freetoken_odd_name_x": "gauge",
    }
    samples = _samples(families)
    assert samples[("freetoken_requests_total", ())] == 3
    assert samples[("freetoken_pcie_bytes_total", ())] == float(1 << 40)
    assert samples[("freetoken_odd_name_x", ())] == math.inf
    assert families["freetoken_requests"].documentation == 'All of them,\nwith a back\\slash and "quotes"'
    assert families["freetoken_expert_cache_hit_rate"].documentation == ""
    # a None gauge is left out entirely
    assert "decode_tokens_per_second" not in text


def test_render_escapes_label_values():
    nasty = 'a "quoted"\\back\nslash'
    text = render_prometheus({"counters": {"requests_finished_total": [({"reason": nasty, "0bad": 1}, 2)]}})
    [family] = parse_exposition(text).values()
    assert [(s.name, s.labels, s.value) for s in family.samples] == [
        ("freetoken_requests_finished_total", {"reason": nasty, "_0bad": "1"}, 2.0)
    ]


def test_render_histogram_adds_inf_bucket_sum_and_count():
    hist = {"buckets": [(1.0, 5), (0.1, 2), (0.5, 4)], "sum": 1.25, "count": 7}
    families = parse_exposition(render_prometheus({"histograms": {"time_to_first_token_seconds": hist}}))
    family = families["freetoken_time_to_first_token_seconds"]
    assert family.type == "histogram"
    check_histogram(family)
    samples = _samples(families)
    name = "freetoken_time_to_first_token_seconds"
    assert [samples[(name + "_bucket", (("le", le),))] for le in ("0.1", "0.5", "1.0", "+Inf")] == [2, 4, 5, 7]
    assert samples[(name + "_sum", ())] == 1.25 and samples[(name + "_count", ())] == 7


def test_render_labelled_histograms_and_explicit_inf_bucket():
    hists = [
        {"labels": {"policy": "hybrid"}, "buckets": [(0.1, 1), (math.inf, 3)], "sum": 0.9, "count": 3},
        {"labels": {"policy": "cpu"}, "buckets": [], "sum": 0, "count": 0},
    ]
    families = parse_exposition(render_prometheus({"histograms": {"step_seconds": hists}}))
    check_histogram(families["freetoken_step_seconds"])
    samples = _samples(families)
    assert samples[("freetoken_step_seconds_bucket", (("le", "+Inf"), ("policy", "hybrid")))] == 3
    assert samples[("freetoken_step_seconds_count", (("policy", "cpu"),))] == 0
    assert sum(name.endswith("_bucket") and value == 3 for (name, _), value in samples.items()) == 1


def test_render_rejects_series_with_different_label_names():
    with pytest.raises(ValueError, match="freetoken_requests_total"):
        render_prometheus({"counters": {"requests_total": [({"a": 1}, 1), ({"b": 2}, 1)]}})


def test_render_engine_snapshot():
    from freetoken.engine.metrics import TTFT_BUCKETS, EngineMetrics

    m = EngineMetrics(requests_total=4, generation_tokens_total=50)
    for seconds in (0.005, 0.01, 0.3, 100.0):
        m.observe_ttft(seconds)
    m.observe_decode(0.5, 10)
    families = parse_exposition(render_prometheus(m.snapshot(running=2, waiting=1)))
    check_histogram(families["freetoken_time_to_first_token_seconds"])
    samples = _samples(families)
    assert samples[("freetoken_time_to_first_token_seconds_bucket", (("le", "0.01"),))] == 2
    assert samples[("freetoken_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 4
    assert sum(name.endswith("_bucket") for name, _ in samples) == len(TTFT_BUCKETS) + 1
    assert samples[("freetoken_waiting_requests", ())] == 1
    assert samples[("freetoken_decode_tokens_per_second", ())] == 20.0
    assert families["freetoken_generation_tokens"].type == "counter"


def test_render_empty_and_special_values():
    assert render_prometheus({}) == ""
    text = render_prometheus({"gauges": {"a": math.nan, "b": -math.inf, "c": True, "d": 1e-7}})
    samples = _samples(parse_exposition(text))
    assert math.isnan(samples[("freetoken_a", ())]) and samples[("freetoken_b", ())] == -math.inf
    assert samples[("freetoken_c", ())] == 1 and samples[("freetoken_d", ())] == 1e-7
