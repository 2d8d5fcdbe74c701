"""The operator routes (cache status and resize, /metrics) over a real socket; the Prometheus
renderer on its own is in test_prometheus.py."""

from __future__ import annotations

import httpx
import pytest

from freetoken.errors import EngineError
from freetoken.server.admin_api import parse_resize_body
from freetoken.server.errors import ApiError
from tests.fakes import FakeLLM
from tests.server_harness import running_server
from tests.test_prometheus import parse_exposition

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
    families = parse_exposition(resp.text)
    assert all(name.startswith("freetoken_") for name in families)
    assert families["freetoken_requests"].type == "counter"
    assert families["freetoken_expert_slots"].type == "gauge"
    assert families["freetoken_time_to_first_token_seconds"].type == "histogram"
    values = {s.name: s.value for f in families.values() for s in f.samples if not s.labels}
    assert values["freetoken_requests_total"] >= 1
    assert values["freetoken_expert_slots"] == 16
    assert families["freetoken_requests"].documentation == "Requests the fake engine received."

    srv.http.post("/v1/cache/resize", json={"moe_slots": 8})
    slots = parse_exposition(srv.http.get("/metrics").text)["freetoken_expert_slots"]
    assert [s.value for s in slots.samples] == [8]

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
