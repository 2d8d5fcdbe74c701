"""The OpenAI-compatible HTTP server, over a real socket, driven by the official `openai` client.

The module-scoped `srv` fixture serves tests/fakes.FakeLLM. Tests that only use the public API
run against any engine: to run them against another one, import this module's tests into a new
module and override `srv`, e.g.

    from tests.test_server_openai import *  # noqa: F403
    from tests.test_server_openai_errors import *  # noqa: F403  (bad requests)
    from tests.test_server_openai_tools import *  # noqa: F403  (tools, reasoning, logprobs)
    @pytest.fixture(scope="module")
    def srv():
        with running_server(lambda: start_demo_engine()) as s:
            yield s

Tests that rely on the fake's scripted behaviour call `fake(srv)`, which skips them otherwise.
"""

from __future__ import annotations

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


def _chat_body(srv, **kw):
    return {"model": srv.llm.model_name, "messages": [{"role": "user", "content": "hi"}], **kw}


def _msgs(*messages):
    return {"messages": list(messages)}


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


# ----------------------------------------------------------------------------- basics


def test_health(http):
    r = http.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["ready"] is True  # the engine's own report, not a constant
    served = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert body["model"] in served and body["requests"] == {"running": 0, "waiting": 0}


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


# ----------------------------------------------------------------------------- health from the engine


def test_health_follows_the_engine():
    state = {"status": "ok", "actors": 3}
    failing = False

    def health():
        if failing:
            raise RuntimeError("actor table unavailable")
        return state

    llm = FakeLLM()
    llm.health = health
    with running_server(llm, config=ServerConfig(port=0)) as s:
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
