"""Bad input the server once mishandled, each now a 4xx in its API's own shape: JSON nested a
thousand deep, errors under /v1/messages in OpenAI's shape, error bodies echoing a huge field,
Anthropic thinking budgets out of range; and the nesting scan on its own."""

from __future__ import annotations

import json

import httpx
import pytest

from freetoken.server.body import json_depth
from tests.fakes import FakeLLM
from tests.reliability.test_http_security import assert_anthropic_error, assert_openai_error
from tests.server_harness import running_server

MODEL = "fake-model"


@pytest.fixture(scope="module")
def http():
    with running_server(FakeLLM(max_model_len=4096)) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        yield client


def _chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def _post_raw(http: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return http.post(path, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_deep_nesting_in_an_unknown_field_is_a_400(http, depth):
    nested = b"[" * depth + b"]" * depth
    chat = json.dumps(_chat()).encode()[:-1] + b', "x": ' + nested + b"}"
    err = assert_openai_error(_post_raw(http, "/v1/chat/completions", chat), 400, "too_deeply_nested")
    assert f"{depth + 1} deep" in err["message"]  # the array inside the body's object
    message = json.dumps(_chat()).encode()[:-1] + b', "metadata": {"deep": ' + nested + b"}}"
    assert_anthropic_error(_post_raw(http, "/v1/messages", message), 400, "invalid_request_error")
    resize = b'{"moe_slots": 8, "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"  # within its 64 KiB limit
    assert_openai_error(_post_raw(http, "/v1/cache/resize", resize), 400, "too_deeply_nested")
    assert http.post("/v1/chat/completions", json=_chat()).status_code == 200  # still serving


def test_moderate_nesting_passes(http):
    schema: dict = {"type": "string"}
    for _ in range(20):
        schema = {"type": "object", "properties": {"a": schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    assert http.post("/v1/chat/completions", json=_chat(tools=[tool])).status_code == 200


def test_json_depth_scans_without_recursing():
    assert json_depth(b"1") == 0 and json_depth(b'"[[["') == 0
    assert json_depth(b'{"a": [1, {"b": []}]}') == 4
    assert json_depth(b'{"a": "]]]]{{{{", "b": [["\\"[["]]}') == 3  # brackets in strings, escaped quotes
    assert json_depth(b"[" * 200_000) == 200_000  # unbalanced (invalid) JSON still measured


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/messages", 405), ("PUT", "/v1/messages/count_tokens", 405), ("GET", "/v1/messages/nope", 404),
    ("POST", "/v1/messages/batches", 404),
])
def test_errors_under_v1_messages_are_anthropic_shaped(http, method, path, status):
    kind = {404: "not_found_error", 405: "invalid_request_error"}[status]
    assert_anthropic_error(http.request(method, path, json={}), status, kind)


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/chat/completions", 405), ("DELETE", "/v1/models", 405), ("GET", "/v1/nope", 404),
    ("GET", "/", 404),
])
def test_other_errors_are_openai_shaped(http, method, path, status):
    assert_openai_error(http.request(method, path), status)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages",
                                  "/v1/messages/count_tokens"])
def test_error_bodies_do_not_echo_huge_values(http, path):
    body = {**_chat(), "prompt": "hi", "model": "m" * 900_000}
    r = http.post(path, json=body)
    assert r.status_code == 404 and len(r.content) < 1000, len(r.content)
    assert "mmmm…" in r.text  # cut, and says so
    if path != "/v1/completions":  # takes a prompt, not messages
        huge_role = {**_chat(), "messages": [{"role": "r" * 500_000, "content": "x"}]}
        role = http.post(path, json=huge_role)
        assert role.status_code == 400 and len(role.content) < 1000
    assert len(http.get("/v1/models/" + "x" * 60_000).content) < 1000


@pytest.mark.parametrize(("thinking", "max_tokens", "fragment"), [
    ({"type": "enabled", "budget_tokens": -1}, 2048, "at least 1024"),
    ({"type": "enabled", "budget_tokens": 1023}, 2048, "at least 1024"),
    ({"type": "enabled", "budget_tokens": 2048}, 2048, "less than max_tokens"),
    ({"type": "enabled"}, 2048, "required"),
    ({"type": "disabled", "budget_tokens": 2000}, 2048, "only allowed with"),
    ({"type": "adaptive", "budget_tokens": 2000}, 2048, "only allowed with"),
])
def test_thinking_budget_follows_anthropics_rules(http, thinking, max_tokens, fragment):
    r = http.post("/v1/messages", json={**_chat(), "max_tokens": max_tokens, "thinking": thinking})
    assert_anthropic_error(r, 400, "invalid_request_error")
    assert fragment in r.json()["error"]["message"]
    counted = http.post("/v1/messages/count_tokens", json={**_chat(), "thinking": thinking})
    assert counted.status_code == (200 if fragment == "less than max_tokens" else 400)


def test_a_thinking_budget_in_range_is_accepted(http):
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}, {"type": "adaptive"}):
        r = http.post("/v1/messages", json={**_chat(), "max_tokens": 1025, "thinking": thinking})
        assert r.status_code == 200, r.text
