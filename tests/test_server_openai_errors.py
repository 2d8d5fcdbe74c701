"""The OpenAI-compatible server's answers to bad requests, over a real socket: the status, the
API's error schema, and a server that keeps serving (the fixtures and helpers of
test_server_openai.py; tests that rely on the fake engine skip against another engine)."""

# ruff: noqa: F811 (the fixtures imported below come back as the tests' parameters, pytest's way)

from __future__ import annotations

import json

import openai
import pytest

from tests.test_server_openai import (  # noqa: F401 (fixtures)
    CHAT,
    COMPLETIONS,
    _chat_body,
    _msgs,
    assert_error_body,
    assert_serving,
    chat,
    client,
    http,
    srv,
)

# (id, path, body overrides (merged into a good body) or raw bytes, status, param, code)
BAD_REQUESTS = [
    ("malformed-json", CHAT, b'{"messages": [', 400, None, "invalid_json"),
    ("empty-body", CHAT, b"", 400, None, "invalid_json"),
    ("top-level-array", CHAT, b"[1, 2]", 400, None, None),
    ("wrong-type", CHAT, {"max_tokens": "ten"}, 400, "max_tokens", None),
    ("stream-not-bool", CHAT, {"stream": "yes"}, 400, "stream", None),
    ("seed-not-int", CHAT, {"seed": "abc"}, 400, "seed", None),
    ("missing-messages", CHAT, {"messages": None}, 400, "messages", None),
    ("empty-messages", CHAT, {"messages": []}, 400, "messages", None),
    ("unknown-role", CHAT, _msgs({"role": "wizard", "content": "x"}), 400, "messages[0].role", None),
    ("missing-content", CHAT, _msgs({"role": "user"}), 400, "messages[0].content", None),
    ("content-wrong-type", CHAT, _msgs({"role": "user", "content": 5}), 400, "messages[0].content", None),
    (
        "image-part",
        CHAT,
        _msgs({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}),
        400,
        "messages[0].content[0].type",
        None,
    ),
    ("negative-max-tokens", CHAT, {"max_tokens": -5}, 400, "max_tokens", None),
    ("zero-max-completion-tokens", CHAT, {"max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    ("temperature-high", CHAT, {"temperature": 2.5}, 400, "temperature", None),
    ("temperature-negative", CHAT, {"temperature": -0.1}, 400, "temperature", None),
    ("top-p-zero", CHAT, {"top_p": 0}, 400, "top_p", None),
    ("top-k-negative", CHAT, {"top_k": -2}, 400, "top_k", None),
    ("n-2", CHAT, {"n": 2}, 400, "n", "unsupported_parameter"),
    ("presence-penalty", CHAT, {"presence_penalty": 0.5}, 400, "presence_penalty", "unsupported_parameter"),
    ("frequency-penalty", CHAT, {"frequency_penalty": 1}, 400, "frequency_penalty", "unsupported_parameter"),
    ("top-logprobs-alone", CHAT, {"top_logprobs": 2}, 400, "top_logprobs", None),
    ("top-logprobs-too-many", CHAT, {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ("tool-type", CHAT, {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, 400, "tools[0].type", None),
    ("tool-choice-required", CHAT, {"tool_choice": "required"}, 400, "tool_choice", "unsupported_parameter"),
    (
        "tool-choice-function",
        CHAT,
        {"tool_choice": {"type": "function", "function": {"name": "f"}}},
        400,
        "tool_choice",
        "unsupported_parameter",
    ),
    ("five-stops", CHAT, {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    ("empty-stop", CHAT, {"stop": [""]}, 400, "stop", None),
    ("json-mode", CHAT, {"response_format": {"type": "json_object"}}, 400, "response_format", None),
    ("unknown-model", CHAT, {"model": "gpt-17"}, 404, "model", "model_not_found"),
    ("batched-prompts", COMPLETIONS, {"prompt": ["a", "b"]}, 400, "prompt", None),
    ("batched-token-prompts", COMPLETIONS, {"prompt": [[1], [2]]}, 400, "prompt", None),
    ("bad-token-id", COMPLETIONS, {"prompt": [-1]}, 400, "prompt", None),
    ("mixed-prompt", COMPLETIONS, {"prompt": [1, "a"]}, 400, "prompt", None),
    ("missing-prompt", COMPLETIONS, {"prompt": None}, 400, "prompt", None),
    ("empty-token-prompt", COMPLETIONS, {"prompt": []}, 400, "prompt", None),
    ("echo", COMPLETIONS, {"echo": True}, 400, "echo", "unsupported_parameter"),
    ("completion-logprobs-too-many", COMPLETIONS, {"logprobs": 21}, 400, "logprobs", None),
    ("best-of", COMPLETIONS, {"best_of": 2}, 400, "best_of", "unsupported_parameter"),
    ("suffix", COMPLETIONS, {"suffix": "end"}, 400, "suffix", "unsupported_parameter"),
]


@pytest.mark.parametrize("name,path,body,status,param,code", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request(http, srv, name, path, body, status, param, code):
    if isinstance(body, dict):
        base = _chat_body(srv) if path == CHAT else {"model": srv.llm.model_name, "prompt": "hi"}
        merged = {**base, **body}
        content = json.dumps({k: v for k, v in merged.items() if v is not None}).encode()
    else:
        content = body
    r = http.post(path, content=content, headers={"content-type": "application/json"})
    assert_error_body(r, status, param=param, code=code)
    assert_serving(http, srv)


def test_context_length(http, client, srv):
    words = " hello" * (srv.llm.max_model_len + 16)
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, srv, words, max_tokens=4)
    assert exc.value.code == "context_length_exceeded" and str(srv.llm.max_model_len) in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=srv.llm.model_name, prompt=words)
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, srv, max_tokens=srv.llm.max_model_len)
    assert exc.value.code == "context_length_exceeded" and exc.value.param == "max_tokens"
    assert_serving(http, srv)


def test_openai_client_surfaces_errors(client, srv):
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, srv, temperature=3)
    assert exc.value.param == "temperature" and "temperature" in exc.value.message
    with pytest.raises(openai.BadRequestError):
        chat(client, srv, n=2)
    with pytest.raises(openai.BadRequestError):
        chat(client, srv, stream=True, presence_penalty=1.0)
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.code == "model_not_found"
    assert chat(client, srv, max_tokens=2).choices[0].message.content is not None


def test_body_too_large(http, srv, client):
    limit = srv.config.max_request_bytes
    body = json.dumps(_chat_body(srv, messages=[{"role": "user", "content": "x" * (limit + 10)}])).encode()
    r = http.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert_error_body(r, 413, code="request_too_large")
    with pytest.raises(openai.APIStatusError) as exc:
        chat(client, srv, "y" * (limit + 10))
    assert exc.value.status_code == 413
    assert_serving(http, srv)


def test_only_json_bodies_are_accepted(http, srv):
    body = json.dumps(_chat_body(srv, max_tokens=2)).encode()
    r = http.post(CHAT, content=body, headers={"content-type": "text/plain"})  # a cross-site form could send it
    assert_error_body(r, 415, code="unsupported_media_type")
    r = http.post(CHAT, content=body, headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"


def test_model_may_be_omitted(http, srv):
    r = http.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == srv.llm.model_name
    r = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == srv.llm.model_name


def test_unknown_route_and_wrong_method(http, srv):
    assert_error_body(http.get("/v1/nope"), 404, code="not_found")
    assert_error_body(http.post("/v2/chat/completions", json={}), 404)
    r = http.get(CHAT)
    assert_error_body(r, 405, code="method_not_allowed")
    assert r.headers["allow"] == "POST"
    assert_error_body(http.delete("/v1/models"), 405)
    assert_serving(http, srv)


def test_messages_forms_accepted(client, srv):
    r = client.chat.completions.create(
        model=srv.llm.model_name,
        max_tokens=4,
        messages=[
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
            {"role": "user", "content": "and now?"},
        ],
    )
    assert r.choices[0].finish_reason in ("stop", "length")
