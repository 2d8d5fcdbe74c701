"""The OpenAI-compatible HTTP server, over a real socket, driven by the official `openai` client.

The module-scoped `srv` fixture serves tests/fakes.FakeLLM. Tests that only use the public API
run against any engine: to run them against another one, import this module's tests into a new
module and override `srv`, e.g.

    from tests.test_server_openai import *  # noqa: F403
    @pytest.fixture(scope="module")
    def srv():
        with running_server(lambda: start_demo_engine()) as s:
            yield s

Tests that rely on the fake's scripted behaviour call `fake(srv)`, which skips them otherwise.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from freetoken.config import ServerConfig
from tests.fakes import REPLY, FakeLLM
from tests.server_harness import RunningServer, running_server


@pytest.fixture(scope="module")
def srv():
    with running_server(FakeLLM()) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv: RunningServer) -> openai.OpenAI:
    return srv.client()


@pytest.fixture(scope="module")
def http(srv: RunningServer):
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


def fake(srv: RunningServer) -> FakeLLM:
    if not isinstance(srv.llm, FakeLLM):
        pytest.skip("needs the fake engine's scripted behaviour")
    return srv.llm


def chat(client, srv, content="Say something.", **kw):
    return client.chat.completions.create(
        model=srv.llm.model_name, messages=[{"role": "user", "content": content}], **kw
    )


def assert_serving(http: httpx.Client, srv: RunningServer) -> None:
    r = http.post(
        "/v1/completions", json={"model": srv.llm.model_name, "prompt": "still up?", "max_tokens": 1}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def _counts(usage) -> tuple[int, int, int]:
    # Not the cached-token details: a repeated prompt may reuse the first one's KV.
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def assert_error_body(r: httpx.Response, status: int, *, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# ----------------------------------------------------------------------------- basics


def test_health(http):
    r = http.get("/health")
    assert r.status_code == 200
    assert r.json()["status"] == "ok"


def test_models(client, srv, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [srv.llm.model_name]
    model = models.data[0]
    assert model.object == "model" and model.owned_by == "freetoken" and model.created > 0
    assert client.models.retrieve(srv.llm.model_name).id == srv.llm.model_name
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("no-such-model")
    assert exc.value.code == "model_not_found"
    assert http.get("/v1/models").json()["object"] == "list"


def test_chat_non_streaming(client, srv):
    r = chat(client, srv, temperature=0, max_tokens=40)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.model == srv.llm.model_name and r.created > 0
    (choice,) = r.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 40
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_chat_streaming_matches_non_streaming(client, srv):
    ref = chat(client, srv, "Tell me a story.", temperature=0, max_tokens=30)
    stream = chat(
        client, srv, "Tell me a story.", temperature=0, max_tokens=30, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    first, *middle, finish, usage_chunk = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert [c.choices[0].finish_reason for c in middle] == [None] * len(middle)
    assert finish.choices[0].finish_reason == ref.choices[0].finish_reason
    assert usage_chunk.choices == [] and _counts(usage_chunk.usage) == _counts(ref.usage)
    text = "".join(c.choices[0].delta.content or "" for c in [first, *middle, finish])
    assert text == ref.choices[0].message.content


def test_chat_streaming_without_usage(client, srv):
    chunks = list(chat(client, srv, temperature=0, max_tokens=5, stream=True))
    assert chunks[-1].choices[0].finish_reason is not None
    assert all(c.usage is None for c in chunks)


def test_completions_both_modes(client, srv):
    kw = dict(model=srv.llm.model_name, prompt="Once upon a time", temperature=0, max_tokens=20)
    ref = client.completions.create(**kw)
    assert ref.id.startswith("cmpl-") and ref.object == "text_completion"
    (choice,) = ref.choices
    assert choice.finish_reason in ("stop", "length") and isinstance(choice.text, str)
    assert ref.usage.total_tokens == ref.usage.prompt_tokens + ref.usage.completion_tokens
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert chunks[-1].choices == [] and _counts(chunks[-1].usage) == _counts(ref.usage)
    assert chunks[-2].choices[0].finish_reason == choice.finish_reason
    assert "".join(c.choices[0].text for c in chunks[:-1]) == choice.text


def test_completions_token_id_prompt(client, srv):
    ids = srv.llm.tokenizer.encode("Once upon a time")
    by_ids = client.completions.create(model=srv.llm.model_name, prompt=ids, temperature=0, max_tokens=8)
    assert by_ids.usage.prompt_tokens == len(ids)
    nested = client.completions.create(model=srv.llm.model_name, prompt=[ids], temperature=0, max_tokens=8)
    assert nested.choices[0].text == by_ids.choices[0].text


def test_max_tokens_gives_length(client, srv):
    r = chat(client, srv, temperature=0, max_tokens=3, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = chat(client, srv, temperature=0, max_completion_tokens=2, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2


def test_stop_strings(client, srv):
    full = chat(client, srv, "Go on.", temperature=0, max_tokens=40).choices[0].message.content
    if len(full) < 12:
        pytest.skip("the engine's greedy reply is too short to pick a stop string from")
    stop = full[8:11]
    expected = full[: full.find(stop)]
    r = chat(client, srv, "Go on.", temperature=0, max_tokens=40, stop=[stop, "never-appears-123"])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    chunks = list(chat(client, srv, "Go on.", temperature=0, max_tokens=40, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_concurrent_requests(client, srv):
    results: list[str] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            chunks = chat(client, srv, "Concurrent.", temperature=0, max_tokens=16, stream=True)
            results.append("".join(c.choices[0].delta.content or "" for c in chunks))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(results) == 4 and len(set(results)) == 1


# ----------------------------------------------------------------------------- bad requests


def _chat_body(srv, **kw):
    return {"model": srv.llm.model_name, "messages": [{"role": "user", "content": "hi"}], **kw}


def _msgs(*messages):
    return {"messages": list(messages)}


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

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


def test_wrong_content_type_is_tolerated(http, srv):
    body = json.dumps(_chat_body(srv, max_tokens=2)).encode()
    r = http.post(CHAT, content=body, headers={"content-type": "text/plain"})
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


# ----------------------------------------------------------------------------- fake-engine specifics


def test_prompt_rendering(client, srv):
    llm = fake(srv)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "developer", "content": "rules-1"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
        },
    ]
    client.chat.completions.create(model=llm.model_name, messages=messages, tools=tools, max_tokens=1)
    (rec,) = llm.find("rules-1")
    assert rec.prompt_text.startswith("<|tools|>") and "get_weather" in rec.prompt_text
    assert "<|system|>rules-1<|end|>" in rec.prompt_text
    assert "<|user|>part one\npart two<|end|>" in rec.prompt_text
    assert rec.prompt_text.endswith("<|assistant|>")
    messages[0]["content"] = "rules-2"
    client.chat.completions.create(
        model=llm.model_name, messages=messages, tools=tools, tool_choice="none", max_tokens=1
    )
    (rec,) = llm.find("rules-2")
    assert "get_weather" not in rec.prompt_text


def test_sampling_params_reach_engine(client, srv):
    llm = fake(srv)
    chat(
        client, srv, "params-probe", temperature=0.5, top_p=0.9, seed=7, stop=["zz"], max_tokens=5,
        extra_body={"top_k": 40, "ignore_eos": True, "stop_token_ids": [3]},
    )  # fmt: skip
    (rec,) = llm.find("params-probe")
    p = rec.params
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.max_tokens) == (0.5, 0.9, 40, 7, ("zz",), 5)
    assert p.ignore_eos and p.stop_token_ids == (3,)
    assert rec.request_id.startswith("chatcmpl-")
    ids = {r.request_id for r in llm.requests}
    assert len(ids) == len(llm.requests)  # unique per request


def test_default_max_tokens_is_rest_of_context(client, srv):
    llm = fake(srv)
    r = chat(client, srv, "[[forever]] fill the context")
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == llm.max_model_len


def test_greedy_reply_and_eos(client, srv):
    fake(srv)
    r = chat(client, srv, temperature=0)
    assert r.choices[0].message.content == REPLY and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(REPLY.encode()) + 1  # + EOS


def test_template_error_is_400(client, srv):
    fake(srv)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=srv.llm.model_name,
            messages=[{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}],
        )
    assert "system message" in exc.value.message


def test_engine_rejection_is_400(client, srv):
    fake(srv)
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, srv, "[[reject]]")
    assert "rejects" in exc.value.message
    with pytest.raises(openai.BadRequestError):
        chat(client, srv, "[[reject]]", stream=True)


@pytest.mark.parametrize("marker", ["[[error]]", "[[raise]]"])
def test_engine_failure(client, srv, http, marker):
    fake(srv)
    with pytest.raises(openai.InternalServerError) as exc:
        chat(client, srv, marker)
    assert "fake" in exc.value.message
    stream = chat(client, srv, marker, stream=True, temperature=0)
    received = []
    with pytest.raises(openai.APIError) as exc:
        for chunk in stream:
            received.append(chunk)
    assert "fake" in exc.value.message
    assert "".join(c.choices[0].delta.content or "" for c in received) == REPLY[:3]
    assert_serving(http, srv)


def _wait_done(llm: FakeLLM, marker: str, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        recs = llm.find(marker)
        if recs and recs[0].done.wait(0.05):
            return recs[0]
        time.sleep(0.01)
    raise AssertionError(f"request {marker!r} did not end")


def test_disconnect_mid_stream_cancels(client, srv, http):
    llm = fake(srv)
    stream = chat(client, srv, "[[slow]] [[forever]] disconnect-stream", max_tokens=400, stream=True)
    it = iter(stream)
    for _ in range(3):
        next(it)
    stream.close()
    rec = _wait_done(llm, "disconnect-stream")
    assert rec.cancelled and not rec.finished
    assert_serving(http, srv)


def test_disconnect_non_streaming_cancels(srv, http):
    llm = fake(srv)
    body = _chat_body(srv, messages=[{"role": "user", "content": "[[slow]] [[forever]] disconnect-wait"}])
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.url}{CHAT}", json={**body, "max_tokens": 400}, timeout=0.3)
    rec = _wait_done(llm, "disconnect-wait")
    assert rec.cancelled and not rec.finished
    assert_serving(http, srv)


# ----------------------------------------------------------------------------- health callback


def test_health_callback():
    state = {"status": "ok", "actors": 3}
    failing = False

    def health():
        if failing:
            raise RuntimeError("actor table unavailable")
        return state

    with running_server(FakeLLM(), health=health, config=ServerConfig(port=0)) as s:
        r = httpx.get(f"{s.url}/health")
        assert r.status_code == 200 and r.json() == {"status": "ok", "actors": 3}
        state["status"] = "degraded"
        r = httpx.get(f"{s.url}/health")
        assert r.status_code == 503 and r.json()["status"] == "degraded"
        failing = True
        r = httpx.get(f"{s.url}/health")
        assert r.status_code == 503 and "actor table unavailable" in r.json()["error"]


def test_shutdown_ends_inflight_requests():
    llm = FakeLLM()
    outcome: dict[str, object] = {}
    with running_server(llm, graceful_shutdown_s=0.2) as s:
        stream = s.client().chat.completions.create(
            model=llm.model_name,
            messages=[{"role": "user", "content": "[[slow]] [[forever]] shutdown"}],
            max_tokens=400,
            stream=True,
        )
        next(iter(stream))

        def drain() -> None:
            try:
                for _ in stream:
                    pass
            except openai.APIError as exc:
                outcome["error"] = exc.message

        reader = threading.Thread(target=drain)
        reader.start()
    reader.join(10)
    assert "shutting down" in str(outcome.get("error"))
    (rec,) = llm.find("shutdown")
    assert rec.done.is_set() and rec.cancelled


def test_port_in_use_is_a_clear_error(srv):
    port = int(srv.url.rsplit(":", 1)[1])
    with pytest.raises(RuntimeError) as exc:
        with running_server(FakeLLM(), config=ServerConfig(port=port)):
            pass
    assert f"cannot listen on 127.0.0.1:{port}" in str(exc.value.__cause__)


# ----------------------------------------------------------------------------- tools, reasoning, logprobs

WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather.", "parameters": {"type": "object"}},
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
CALL_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_TIME = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'


def test_tool_call_round_trip(client, srv):
    llm = fake(srv)
    llm.script("[[weather-trip]]", f"Let me check.\n{CALL_WEATHER}")
    messages = [{"role": "user", "content": "[[weather-trip]] What's the weather in Paris?"}]
    r = client.chat.completions.create(model=llm.model_name, messages=messages, tools=[WEATHER_TOOL])
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"})
    r = client.chat.completions.create(model=llm.model_name, messages=messages, tools=[WEATHER_TOOL])
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls
    prompt = llm.find("18 C and sunny")[0].prompt_text
    assert f"<|tool|>18 C and sunny<|id|>{call.id}<|end|>" in prompt
    assert '"name": "get_weather"' in prompt and call.id in prompt.split("<|tool|>")[0]  # the assistant's call


def test_tool_calls_and_reasoning_streamed(client, srv):
    llm = fake(srv)
    reply = f"<think>\nTwo lookups.\n</think>\n\nChecking.\n{CALL_WEATHER}\n{CALL_TIME}"
    llm.script("[[two-calls]]", reply, reply)
    kw = dict(model=llm.model_name, tools=[TIME_TOOL], temperature=0)  # (a short prompt: the fake's context is small)
    messages = [{"role": "user", "content": "[[two-calls]]"}]
    ref = client.chat.completions.create(messages=messages, **kw).choices[0]
    assert ref.finish_reason == "tool_calls" and ref.message.content == "Checking."
    assert ref.message.model_extra["reasoning_content"] == "Two lookups."
    assert [c.function.name for c in ref.message.tool_calls] == ["get_weather", "get_time"]

    chunks = list(client.chat.completions.create(messages=messages, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == "Checking."
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "Two lookups."
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    assert [(tc.index, tc.function.name) for tc in calls] == [(0, "get_weather"), (1, "get_time")]
    assert [json.loads(tc.function.arguments) for tc in calls] == [{"city": "Paris"}, {"zone": "CET"}]
    assert all(tc.id.startswith("call_") and tc.type == "function" for tc in calls)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_and_no_tools_keep_text(client, srv):
    llm = fake(srv)
    llm.script("[[no-parse]]", CALL_WEATHER, CALL_WEATHER)
    messages = [{"role": "user", "content": "[[no-parse]] hi"}]
    for kw in ({"tools": [WEATHER_TOOL], "tool_choice": "none"}, {}):
        r = client.chat.completions.create(model=llm.model_name, messages=messages, **kw)
        assert r.choices[0].message.content == CALL_WEATHER and r.choices[0].finish_reason == "stop"
        assert not r.choices[0].message.tool_calls


def test_malformed_tool_call_is_text(client, srv):
    llm = fake(srv)
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'
    llm.script("[[bad-call]]", bad, bad)
    messages = [{"role": "user", "content": "[[bad-call]] hi"}]
    r = client.chat.completions.create(model=llm.model_name, messages=messages, tools=[WEATHER_TOOL])
    assert r.choices[0].message.content == bad and r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=llm.model_name, messages=messages, tools=[WEATHER_TOOL], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == bad


def test_mixtral_tool_calls_need_special_tokens():
    llm = FakeLLM(arch="mixtral")
    llm.script("[[mixtral]]", '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "CET"}}]')
    with running_server(llm) as s:
        client = s.client()
        messages = [{"role": "user", "content": "[[mixtral]] time?"}]
        r = client.chat.completions.create(model=llm.model_name, messages=messages, tools=[TIME_TOOL])
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert r.choices[0].message.tool_calls[0].function.name == "get_time"
        client.chat.completions.create(model=llm.model_name, messages=[{"role": "user", "content": "no tools"}])
        with_tools, without = llm.find("[[mixtral]]")[0], llm.find("no tools")[0]
        assert with_tools.params.skip_special_tokens is False and without.params.skip_special_tokens is True


def _check_top(entry, n: int) -> None:
    assert len(entry.top_logprobs) == n
    values = [t.logprob for t in entry.top_logprobs]
    assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)


def test_chat_logprobs(client, srv):
    kw = dict(temperature=0, max_tokens=12, logprobs=True, top_logprobs=3)
    r = chat(client, srv, "Logprobs, please.", **kw)
    (choice,) = r.choices
    entries = choice.logprobs.content
    stop_token = choice.finish_reason == "stop"
    assert len(entries) == r.usage.completion_tokens - stop_token  # the EOS that ended it has none
    for entry in entries:
        assert isinstance(entry.token, str) and entry.logprob <= 0 and isinstance(entry.bytes, list)
        _check_top(entry, 3)
    streamed = [
        e for c in chat(client, srv, "Logprobs, please.", stream=True, **kw) if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]  # fmt: skip
    assert [e.token for e in streamed] == [e.token for e in entries]
    r = chat(client, srv, "No top.", temperature=0, max_tokens=4, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    assert chat(client, srv, "None.", max_tokens=2).choices[0].logprobs is None


def test_chat_logprobs_spell_the_text(client, srv):
    fake(srv)  # the real engine's text drops special tokens, which logprobs show
    r = chat(client, srv, "Spell it.", temperature=0, logprobs=True, top_logprobs=2)
    entries = r.choices[0].logprobs.content
    assert b"".join(bytes(e.bytes) for e in entries).decode() == r.choices[0].message.content == REPLY
    assert entries[0].token == "H" and entries[0].top_logprobs[0].token == "H"
    assert any(e.token == "\ufffd" and len(e.bytes) == 1 for e in entries)  # a piece of "Ü"


def test_completion_logprobs(client, srv):
    kw = dict(model=srv.llm.model_name, prompt="Once upon a time", temperature=0, max_tokens=10, logprobs=2)
    ref = client.completions.create(**kw)
    lp = ref.choices[0].logprobs
    n = len(lp.tokens)
    assert n == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    chunks = list(client.completions.create(**kw, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert streamed == lp.tokens and offsets == lp.text_offset


def test_cached_tokens(client, srv):
    fake(srv)
    content = "[[cache]] a long shared prefix that the second request reuses " * 2
    first = chat(client, srv, content, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = chat(client, srv, content, max_tokens=2)
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    chunks = list(chat(client, srv, content, max_tokens=2, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens_details.cached_tokens


def test_token_bytes_of_a_byte_level_vocabulary():
    from tokenizers import Tokenizer, pre_tokenizers

    from freetoken.loader.tokenizer_builder import tokenizer_json_for
    from freetoken.server.logprobs import TokenStrings, byte_level_alphabet

    assert set(byte_level_alphabet()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(byte_level_alphabet().values()) == list(range(256))
    tok = Tokenizer.from_str(tokenizer_json_for("qwen3_moe"))
    text = "Ünïcödé ✓ 你好 🚀 plain"
    strings = TokenStrings(tok)
    pieces = [strings.get(i) for i in tok.encode(text).ids]
    assert any(t == "\ufffd" for t, _ in pieces)  # some tokens hold only part of a character
    assert b"".join(bytes(raw) for _, raw in pieces) == text.encode()
