"""The operator routes (cache status and resize, /metrics) over a real socket, and the
Prometheus renderer on its own."""

from __future__ import annotations

import math
import re

import httpx
import pytest

from freetoken.errors import EngineError
from freetoken.server.admin_api import parse_resize_body, render_prometheus
from freetoken.server.errors import ApiError
from tests.fakes import FakeLLM
from tests.server_harness import running_server

# ----------------------------------------------------------------------------- parsing the exposition

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_VALUE = r"[-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|Inf)|NaN"
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{({_LABEL}(?:,{_LABEL})*)\}})? ({_VALUE})$")
_LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), value)


def parse_exposition(text: str) -> tuple[dict[str, str], list[tuple[str, dict[str, str], float]]]:
    """({family: type}, [(name, labels, value)]), asserting the text is well formed."""
    assert text == "" or text.endswith("\n")
    types: dict[str, str] = {}
    samples: list[tuple[str, dict[str, str], float]] = []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped")
            assert name not in types, f"two TYPE lines for {name}"
            types[name] = kind
            continue
        if line.startswith("#"):
            assert re.match(rf"^# HELP {_NAME} .*$", line), line
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, labels, value = m.groups()
        pairs = {k: _unescape(v) for k, v in _LABEL_PAIR.findall(labels or "")}
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        assert family in types, f"{name} has no TYPE line before it"
        samples.append((name, pairs, float(value)))
    return types, samples


def check_histograms(types: dict[str, str], samples: list[tuple[str, dict[str, str], float]]) -> None:
    for family, kind in types.items():
        if kind != "histogram":
            continue
        series: dict[tuple, dict] = {}
        for name, labels, value in samples:
            if not name.startswith(family + "_"):
                continue
            key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
            s = series.setdefault(key, {"buckets": []})
            suffix = name[len(family) + 1 :]
            if suffix == "bucket":
                s["buckets"].append((float(labels["le"]), value))
            else:
                s[suffix] = value
        assert series, f"histogram {family} has no samples"
        for s in series.values():
            les = [le for le, _ in s["buckets"]]
            counts = [n for _, n in s["buckets"]]
            assert les == sorted(les) and les[-1] == math.inf, les
            assert counts == sorted(counts), f"{family} buckets are not cumulative: {counts}"
            assert counts[-1] == s["count"]
            assert "sum" in s


# ----------------------------------------------------------------------------- render_prometheus


def test_render_counters_gauges_and_help():
    text = render_prometheus(
        {
            "counters": {"requests_total": 3, "freetoken_pcie_bytes_total": 1 << 40},
            "gauges": {"expert_cache_hit_rate": 0.5, "decode_tokens_per_second": None, "odd-name.x": math.inf},
            "help": {"requests_total": 'All of them,\nwith a back\\slash and "quotes"'},
        }
    )
    types, samples = parse_exposition(text)
    assert types == {
        "freetoken_requests_total": "counter",
        "freetoken_pcie_bytes_total": "counter",
        "freetoken_expert_cache_hit_rate": "gauge",
        "freetoken_odd_name_x": "gauge",
    }
    assert ("freetoken_requests_total", {}, 3.0) in samples
    assert ("freetoken_pcie_bytes_total", {}, float(1 << 40)) in samples
    assert "freetoken_odd_name_x +Inf\n" in text
    assert '# HELP freetoken_requests_total All of them,\\nwith a back\\\\slash and "quotes"\n' in text
    # no HELP given, no HELP line
    assert "# HELP freetoken_expert_cache_hit_rate" not in text
    # a None gauge is left out entirely
    assert "decode_tokens_per_second" not in text
    lines = text.splitlines()
    assert lines.index("# TYPE freetoken_requests_total counter") < lines.index("freetoken_requests_total 3")


def test_render_escapes_label_values():
    nasty = 'a "quoted"\\back\nslash'
    text = render_prometheus({"counters": {"requests_finished_total": [({"reason": nasty, "0bad": 1}, 2)]}})
    types, samples = parse_exposition(text)
    assert samples == [("freetoken_requests_finished_total", {"reason": nasty, "_0bad": "1"}, 2.0)]
    assert 'reason="a \\"quoted\\"\\\\back\\nslash"' in text


def test_render_histogram_adds_inf_bucket_sum_and_count():
    hist = {"buckets": [(1.0, 5), (0.1, 2), (0.5, 4)], "sum": 1.25, "count": 7}
    text = render_prometheus({"histograms": {"time_to_first_token_seconds": hist}})
    assert text.splitlines()[-6:] == [
        'freetoken_time_to_first_token_seconds_bucket{le="0.1"} 2',
        'freetoken_time_to_first_token_seconds_bucket{le="0.5"} 4',
        'freetoken_time_to_first_token_seconds_bucket{le="1.0"} 5',
        'freetoken_time_to_first_token_seconds_bucket{le="+Inf"} 7',
        "freetoken_time_to_first_token_seconds_sum 1.25",
        "freetoken_time_to_first_token_seconds_count 7",
    ]
    types, samples = parse_exposition(text)
    assert types == {"freetoken_time_to_first_token_seconds": "histogram"}
    check_histograms(types, samples)


def test_render_labelled_histograms_and_explicit_inf_bucket():
    hists = [
        {"labels": {"policy": "hybrid"}, "buckets": [(0.1, 1), (math.inf, 3)], "sum": 0.9, "count": 3},
        {"labels": {"policy": "cpu"}, "buckets": [], "sum": 0, "count": 0},
    ]
    text = render_prometheus({"histograms": {"step_seconds": hists}})
    types, samples = parse_exposition(text)
    check_histograms(types, samples)
    assert text.count('le="+Inf"') == 2
    assert 'freetoken_step_seconds_bucket{policy="hybrid",le="+Inf"} 3' in text
    assert 'freetoken_step_seconds_count{policy="cpu"} 0' in text


def test_render_engine_snapshot():
    from freetoken.engine.metrics import TTFT_BUCKETS, EngineMetrics

    m = EngineMetrics(requests_total=4, generation_tokens_total=50)
    for seconds in (0.005, 0.01, 0.3, 100.0):
        m.observe_ttft(seconds)
    m.observe_decode(0.5, 10)
    types, samples = parse_exposition(render_prometheus(m.snapshot(running=2, waiting=1)))
    check_histograms(types, samples)
    values = {(name, labels.get("le")): v for name, labels, v in samples}
    assert values[("freetoken_time_to_first_token_seconds_bucket", "0.01")] == 2
    assert values[("freetoken_time_to_first_token_seconds_bucket", "+Inf")] == 4
    assert sum(name.endswith("_bucket") for name, _, _ in samples) == len(TTFT_BUCKETS) + 1
    assert values[("freetoken_waiting_requests", None)] == 1
    assert values[("freetoken_decode_tokens_per_second", None)] == 20.0
    assert types["freetoken_generation_tokens_total"] == "counter"


def test_render_empty_and_special_values():
    assert render_prometheus({}) == ""
    text = render_prometheus({"gauges": {"a": math.nan, "b": -math.inf, "c": True, "d": 1e-7}})
    assert "freetoken_a NaN\n" in text and "freetoken_b -Inf\n" in text
    assert "freetoken_c 1\n" in text and "freetoken_d 1e-07\n" in text
    parse_exposition(text)


# ----------------------------------------------------------------------------- resize bodies


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"not json", None),
        (b"[1, 2]", None),
        (b"{}", "moe_slots"),
        (b'{"moe_slots": null, "kv_tokens": null}', "moe_slots"),
        (b'{"moe_slots": 8, "slots": 3}', "slots"),
        (b'{"moe_slots": "8"}', "moe_slots"),
        (b'{"moe_slots": true}', "moe_slots"),
        (b'{"kv_tokens": 1024.0}', "kv_tokens"),
        (b'{"kv_tokens": 0}', "kv_tokens"),
        (b'{"kv_tokens": -5}', "kv_tokens"),
        (b'{"kv_tokens": [4096]}', "kv_tokens"),
    ],
)
def test_parse_resize_body_rejects(body, param):
    with pytest.raises(ApiError) as info:
        parse_resize_body(body)
    assert info.value.status == 400
    assert info.value.param == param
    if param:
        assert param in info.value.message


def test_parse_resize_body_accepts():
    assert parse_resize_body(b'{"moe_slots": 8}') == {"moe_slots": 8, "kv_tokens": None}
    assert parse_resize_body(b'{"moe_slots": null, "kv_tokens": 4096}') == {"moe_slots": None, "kv_tokens": 4096}


# ----------------------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def server():
    with running_server(FakeLLM()) as srv:
        yield srv


@pytest.fixture
def srv(server):
    server.llm.moe_slots, server.llm.kv_tokens = FakeLLM.moe_slots, FakeLLM.kv_tokens
    with httpx.Client(base_url=server.url, timeout=30) as http:
        server.http = http
        yield server


def _assert_error(resp: httpx.Response, status: int, fragment: str, param: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert fragment in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param


def test_cache_status(srv):
    resp = srv.http.get("/v1/cache/status")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert body["expert_slots"] == 16 and body["kv_tokens"] == 8192 and body["policy"] == "hybrid"


def test_resize_ok(srv):
    resp = srv.http.post("/v1/cache/resize", json={"moe_slots": 32, "kv_tokens": None})
    assert resp.status_code == 200, resp.text
    assert resp.json()["expert_slots"] == 32 and resp.json()["kv_tokens"] == 8192
    resp = srv.http.post("/v1/cache/resize", json={"kv_tokens": 4096})
    assert resp.status_code == 200
    assert srv.http.get("/v1/cache/status").json() == resp.json()
    assert resp.json()["expert_slots"] == 32 and resp.json()["kv_tokens"] == 4096


@pytest.mark.parametrize(
    ("body", "fragment", "param"),
    [
        ({"moe_slots": 100}, "more than the model's 64 experts", "moe_slots"),
        ({"kv_tokens": 100}, "cannot hold one 512-token sequence", "kv_tokens"),
        ({"moe_slots": 60, "kv_tokens": 8192}, "60 expert slots and 8192 KV tokens need", None),
    ],
)
def test_resize_rejected_keeps_caches(srv, body, fragment, param):
    before = srv.http.get("/v1/cache/status").json()
    _assert_error(srv.http.post("/v1/cache/resize", json=body), 400, fragment, param)
    assert srv.http.get("/v1/cache/status").json() == before


@pytest.mark.parametrize(
    ("content", "fragment", "param"),
    [
        (b"{", "not valid JSON", None),
        (b'"kv_tokens"', "must be a JSON object", None),
        (b"{}", "Give `moe_slots` and/or `kv_tokens`", "moe_slots"),
        (b'{"moe_slots": 8, "gpu": 1}', "Unknown field `gpu`", "gpu"),
        (b'{"moe_slots": "8"}', "`moe_slots` must be a positive integer", "moe_slots"),
        (b'{"kv_tokens": 0}', "`kv_tokens` must be a positive integer", "kv_tokens"),
        (b'{"kv_tokens": 2.5}', "`kv_tokens` must be a positive integer", "kv_tokens"),
    ],
)
def test_resize_bad_bodies(srv, content, fragment, param):
    before = srv.http.get("/v1/cache/status").json()
    resp = srv.http.post("/v1/cache/resize", content=content, headers={"content-type": "application/json"})
    _assert_error(resp, 400, fragment, param)
    assert srv.http.get("/v1/cache/status").json() == before


def test_resize_body_too_large_and_wrong_method(srv):
    big = srv.http.post("/v1/cache/resize", content=b" " * (100 << 10), headers={"content-type": "application/json"})
    _assert_error(big, 413, "exceeds the limit")
    _assert_error(srv.http.get("/v1/cache/resize"), 405, "Method not allowed")


def test_engine_failure_is_a_500(srv, monkeypatch):
    async def broken() -> dict:
        raise EngineError("the governor is gone")

    monkeypatch.setattr(srv.llm, "cache_status", broken)
    _assert_error(srv.http.get("/v1/cache/status"), 500, "the governor is gone")


def test_metrics(srv):
    srv.client().completions.create(model="fake-model", prompt="hi", max_tokens=4)
    resp = srv.http.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    types, samples = parse_exposition(resp.text)
    check_histograms(types, samples)
    assert all(name.startswith("freetoken_") for name in types)
    assert types["freetoken_requests_total"] == "counter"
    assert types["freetoken_expert_slots"] == "gauge"
    assert types["freetoken_time_to_first_token_seconds"] == "histogram"
    values = {name: v for name, labels, v in samples if not labels}
    assert values["freetoken_requests_total"] >= 1
    assert values["freetoken_expert_slots"] == 16
    assert "# HELP freetoken_requests_total Requests the fake engine received.\n" in resp.text

    srv.http.post("/v1/cache/resize", json={"moe_slots": 8})
    assert "\nfreetoken_expert_slots 8\n" in srv.http.get("/metrics").text


def test_resize_needs_the_admin_token_when_one_is_set():
    from freetoken.config import ServerConfig
    from tests.fakes import FakeLLM
    from tests.server_harness import running_server

    with running_server(FakeLLM(), config=ServerConfig(port=0, admin_token="s3cret")) as s:
        with httpx.Client(base_url=s.url, timeout=10) as http:
            denied = http.post("/v1/cache/resize", json={"moe_slots": 8})
            wrong = http.post("/v1/cache/resize", json={"moe_slots": 8}, headers={"Authorization": "Bearer x"})
            allowed = http.post("/v1/cache/resize", json={"moe_slots": 8},
                                headers={"Authorization": "Bearer s3cret"})
            status = http.get("/v1/cache/status")  # reading needs no token
    assert denied.status_code == 401 and wrong.status_code == 401 and "admin token" in denied.json()["error"]["message"]
    assert allowed.status_code == 200 and status.status_code == 200
