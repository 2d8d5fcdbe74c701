"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens), over a real socket,
driven by the official `anthropic` client; tests/fakes.FakeLLM is scripted to think and to call
tools. The last test runs a few requests through the real engine and chat template.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from freetoken.config import EngineConfig
from freetoken.engine.llm import AsyncLLM
from tests.fakes import REPLY, FakeLLM
from tests.server_harness import RunningServer, running_server

WEATHER_TOOL = {"name": "get_weather", "description": "Weather.", "input_schema": {"type": "object"}}
CALL_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def srv():
    # A context that fits an extended-thinking request (budget_tokens >= 1024 < max_tokens).
    with running_server(FakeLLM(max_model_len=4096)) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def http(srv: RunningServer):
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


def ask(client, srv, content="Say something.", **kw):
    kw.setdefault("max_tokens", 200)
    return client.messages.create(model=srv.llm.model_name, messages=[{"role": "user", "content": content}], **kw)


def events_of(client, srv, content, **kw) -> list:
    kw.setdefault("max_tokens", 200)
    messages = kw.pop("messages", [{"role": "user", "content": content}])
    return list(client.messages.create(model=srv.llm.model_name, messages=messages, stream=True, **kw))


# ----------------------------------------------------------------------------- messages


def test_message(client, srv):
    r = ask(client, srv, extra_body={"temperature": 0})
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant"
    assert r.model == srv.llm.model_name
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == REPLY
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    assert r.usage.output_tokens == len(REPLY.encode()) + 1  # + EOS
    assert r.usage.input_tokens > 0 and r.usage.cache_read_input_tokens == 0


def test_stream_events_and_final_message(client, srv):
    ref = ask(client, srv, "Stream it.", extra_body={"temperature": 0})
    events = events_of(client, srv, "Stream it.", extra_body={"temperature": 0})
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens == ref.usage.input_tokens and events[0].message.content == []
    assert "".join(e.delta.text for e in events[2:-3]) == REPLY
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens == ref.usage.output_tokens
    with client.messages.stream(
        model=srv.llm.model_name,
        max_tokens=200,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Stream it."}],
    ) as stream:
        final = stream.get_final_message()
    assert final.to_dict()["content"] == ref.to_dict()["content"]
    assert final.stop_reason == ref.stop_reason and final.usage == ref.usage


def test_max_tokens_and_stop_sequences(client, srv):
    r = ask(client, srv, max_tokens=5, extra_body={"temperature": 0})
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 5 and r.content[0].text == REPLY[:5]
    r = ask(client, srv, stop_sequences=["zzz", "quick"], extra_body={"temperature": 0})
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "quick"
    assert r.content[0].text == REPLY[: REPLY.index("quick")]
    events = events_of(client, srv, "Stop.", stop_sequences=["fox"], extra_body={"temperature": 0})
    assert events[-2].delta.stop_reason == "stop_sequence" and events[-2].delta.stop_sequence == "fox"


def test_prompt_conversion(client, srv):
    llm: FakeLLM = srv.llm
    client.messages.create(
        model=llm.model_name,
        max_tokens=1,
        system=[{"type": "text", "text": "rules-a"}, {"type": "text", "text": "rules-b"}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "secret-thought", "signature": "sig"},
                    {"type": "text", "text": "Calling."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "-3 C"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "timeout", "is_error": True},
                    {"type": "text", "text": "convert-probe"},
                ],
            },
        ],
        tools=[WEATHER_TOOL],
        metadata={"user_id": "someone"},
    )
    (rec,) = llm.find("convert-probe")
    prompt = rec.prompt_text
    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Weather.", "parameters": {"type": "object"}},
        }
    ]
    assert prompt.startswith(f"<|tools|>{json.dumps(tools, sort_keys=True)}<|end|>\n<|system|>rules-a\nrules-b<|end|>")
    assert "<|user|>part one\npart two<|end|>" in prompt
    calls = [{"function": {"arguments": {"city": "Oslo"}, "name": "get_weather"}, "id": "toolu_1", "type": "function"}]
    assert f"<|assistant|>Calling.<|calls|>{json.dumps(calls, sort_keys=True)}<|end|>" in prompt
    assert (
        "<|tool|>-3 C<|id|>toolu_1<|end|>\n<|tool|>Error: timeout<|id|>toolu_2<|end|>\n<|user|>convert-probe" in prompt
    )
    assert "secret-thought" not in prompt and prompt.endswith("<|assistant|>")


def test_prefill_continues_the_assistant_turn(client, srv):
    llm: FakeLLM = srv.llm
    client.messages.create(
        model=llm.model_name,
        max_tokens=1,
        messages=[{"role": "user", "content": "prefill-probe"}, {"role": "assistant", "content": "The answer is"}],
    )
    (rec,) = llm.find("prefill-probe")
    assert rec.prompt_text.endswith("<|user|>prefill-probe<|end|>\n<|assistant|>The answer is")


def test_tool_use_round_trip(client, srv):
    llm: FakeLLM = srv.llm
    llm.script("[[weather-trip]]", f"Let me check.\n{CALL_WEATHER}")
    messages = [{"role": "user", "content": "[[weather-trip]] Weather in Paris?"}]
    r = client.messages.create(model=llm.model_name, max_tokens=200, messages=messages, tools=[WEATHER_TOOL])
    assert r.stop_reason == "tool_use"
    assert [b.type for b in r.content] == ["text", "tool_use"] and r.content[0].text == "Let me check."
    use = r.content[1]
    assert use.id.startswith("toolu_") and use.name == "get_weather" and use.input == {"city": "Paris"}
    messages += [
        {"role": "assistant", "content": r.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C and sunny"}]},
    ]
    r = client.messages.create(model=llm.model_name, max_tokens=50, messages=messages, tools=[WEATHER_TOOL])
    assert r.stop_reason in ("end_turn", "max_tokens")
    prompt = llm.find("18 C and sunny")[0].prompt_text
    assert f"<|tool|>18 C and sunny<|id|>{use.id}<|end|>" in prompt and '"city": "Paris"' in prompt


def test_tool_use_streamed(client, srv):
    llm: FakeLLM = srv.llm
    llm.script("[[stream-call]]", f"On it.\n{CALL_WEATHER}")
    events = events_of(client, srv, "[[stream-call]]", tools=[WEATHER_TOOL])
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["text", "tool_use"] and starts[1].name == "get_weather"
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta" and e.index == 1)
    assert json.loads(partial) == {"city": "Paris"}
    assert events[-2].delta.stop_reason == "tool_use"
    llm.script("[[stream-call-2]]", f"On it.\n{CALL_WEATHER}")
    with client.messages.stream(
        model=llm.model_name,
        max_tokens=200,
        tools=[WEATHER_TOOL],
        messages=[{"role": "user", "content": "[[stream-call-2]]"}],
    ) as stream:
        final = stream.get_final_message()
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"


def test_thinking_blocks(client, srv):
    llm: FakeLLM = srv.llm
    llm.script("[[think]]", "<think>\nEasy sum.\n</think>\n\nIt is 4.", "<think>\nEasy sum.\n</think>\n\nIt is 4.")
    r = ask(client, srv, "[[think]] 2 + 2?")
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r.content] == [
        ("thinking", "Easy sum."),
        ("text", "It is 4."),
    ]
    assert r.content[0].signature == ""
    events = events_of(client, srv, "[[think]] 2 + 2?")
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == "Easy sum."
    assert "".join(d.text for d in deltas if d.type == "text_delta") == "It is 4."
    # A template that opens <think> itself (enable_thinking): the output starts inside the block.
    llm.script("[[open-think]]", "Still thinking.\n</think>\n\nDone.")
    r = ask(client, srv, "[[open-think]]", max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in r.content] == ["thinking", "text"] and r.content[0].thinking == "Still thinking."
    assert llm.find("[[open-think]]")[0].prompt_text.endswith("<|assistant|><think>\n")


def test_tool_choice_none_keeps_text(client, srv):
    llm: FakeLLM = srv.llm
    llm.script("[[choice-none]]", CALL_WEATHER)
    r = ask(client, srv, "[[choice-none]]", tools=[WEATHER_TOOL], tool_choice={"type": "none"})
    assert r.stop_reason == "end_turn" and r.content[0].text == CALL_WEATHER
    assert "get_weather" not in llm.find("[[choice-none]]")[0].prompt_text  # not shown to the model either


def test_count_tokens_matches_usage(client, srv):
    kw = dict(
        model=srv.llm.model_name,
        system="Be brief.",
        tools=[WEATHER_TOOL],
        messages=[{"role": "user", "content": "How many tokens is this?"}],
    )
    counted = client.messages.count_tokens(**kw).input_tokens
    r = client.messages.create(max_tokens=3, **kw)
    assert counted == r.usage.input_tokens + r.usage.cache_read_input_tokens > 0


def test_cached_tokens_reported(client, srv):
    content = "[[cache]] a prefix long enough to be worth reusing between two requests"
    ask(client, srv, content, max_tokens=2)
    r = ask(client, srv, content, max_tokens=2)
    total = client.messages.count_tokens(model=srv.llm.model_name, messages=[{"role": "user", "content": content}])
    assert r.usage.cache_read_input_tokens > 0
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == total.input_tokens
    start = events_of(client, srv, content, max_tokens=2)[0]
    assert start.message.usage.cache_read_input_tokens == r.usage.cache_read_input_tokens


# ----------------------------------------------------------------------------- errors


def _body(srv, **kw):
    body = {"model": srv.llm.model_name, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], **kw}
    return {k: v for k, v in body.items() if v is not None}


def _user(*blocks):
    return {"messages": [{"role": "user", "content": list(blocks)}]}


# (id, body overrides or raw bytes, status, error type, words the message must contain)
BAD = [
    ("malformed-json", b'{"model": "x", ', 400, "invalid_request_error", "not valid JSON"),
    ("empty-body", b"", 400, "invalid_request_error", "empty"),
    ("missing-max-tokens", {"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ("missing-model", {"model": None}, 400, "invalid_request_error", "model"),
    ("unknown-model", {"model": "claude-9"}, 404, "not_found_error", "claude-9"),
    ("zero-max-tokens", {"max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ("temperature", {"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ("top-k", {"top_k": -1}, 400, "invalid_request_error", "top_k"),
    ("empty-stop", {"stop_sequences": [""]}, 400, "invalid_request_error", "stop_sequences"),
    ("no-messages", {"messages": []}, 400, "invalid_request_error", "messages"),
    ("bad-role", {"messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error", "role"),
    ("content-type", {"messages": [{"role": "user", "content": 5}]}, 400, "invalid_request_error", "content"),
    ("tool-choice-any", {"tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool_choice"),
    ("tool-choice-tool", {"tool_choice": {"type": "tool", "name": "f"}}, 400, "invalid_request_error", "tool_choice"),
    (
        "server-tool",
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        400,
        "invalid_request_error",
        "server tools",
    ),
    (
        "image",
        _user({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}),
        400,
        "invalid_request_error",
        "image",
    ),
    ("tool-result-no-id", _user({"type": "tool_result", "content": "x"}), 400, "invalid_request_error", "tool_use_id"),
    (
        "tool-use-from-user",
        _user({"type": "tool_use", "id": "t", "name": "f", "input": {}}),
        400,
        "invalid_request_error",
        "tool_use",
    ),
    ("system-image", {"system": [{"type": "image"}]}, 400, "invalid_request_error", "system"),
    ("thinking-type", {"thinking": {"type": "sometimes"}}, 400, "invalid_request_error", "thinking"),
]


@pytest.mark.parametrize("name,body,status,kind,words", BAD, ids=[b[0] for b in BAD])
def test_bad_request(http, srv, name, body, status, kind, words):
    content = body if isinstance(body, bytes) else json.dumps(_body(srv, **body)).encode()
    r = http.post("/v1/messages", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and words in err["error"]["message"], err
    assert_serving(http, srv)


def assert_serving(http, srv) -> None:
    r = http.post("/v1/messages", json=_body(srv, max_tokens=1))
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 1


def test_count_tokens_errors(http, srv):
    r = http.post("/v1/messages/count_tokens", json={"model": srv.llm.model_name, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = http.post("/v1/messages/count_tokens", json={"model": "other", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_oversized_and_overlong(client, http, srv):
    limit = srv.config.max_request_bytes
    r = http.post("/v1/messages", json=_body(srv, messages=[{"role": "user", "content": "x" * (limit + 10)}]))
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    with pytest.raises(anthropic.BadRequestError) as exc:
        ask(client, srv, " hello" * (srv.llm.max_model_len + 16))
    assert str(srv.llm.max_model_len) in exc.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as exc:
        ask(client, srv, max_tokens=srv.llm.max_model_len)
    assert "max_tokens" in exc.value.body["error"]["message"]
    assert_serving(http, srv)


def test_engine_errors(client, http, srv):
    with pytest.raises(anthropic.BadRequestError) as exc:
        ask(client, srv, "[[reject]]")
    assert "rejects" in exc.value.body["error"]["message"]
    with pytest.raises(anthropic.InternalServerError) as exc:
        ask(client, srv, "[[error]]")
    assert exc.value.body["error"]["type"] == "api_error" and "fake failure" in exc.value.body["error"]["message"]
    with pytest.raises(anthropic.APIStatusError) as exc:
        events_of(client, srv, "[[raise]]")
    assert "fake crash" in str(exc.value)
    assert_serving(http, srv)


# ----------------------------------------------------------------------------- the real engine


def test_real_engine_and_template(make_checkpoint):
    model_dir = make_checkpoint("qwen3_moe", "tiny")
    config = EngineConfig(model=str(model_dir), device="cpu", max_model_len=512, served_model_name="demo")
    with running_server(lambda: AsyncLLM.start(config)) as s:
        client = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0, timeout=60)
        kw = dict(
            model="demo",
            system="Be brief.",
            tools=[WEATHER_TOOL],
            messages=[
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
                    ],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "-3 C"}]},
            ],
        )
        counted = client.messages.count_tokens(**kw).input_tokens
        r = client.messages.create(max_tokens=8, extra_body={"temperature": 0}, **kw)
        assert counted == r.usage.input_tokens + r.usage.cache_read_input_tokens
        assert r.stop_reason in ("end_turn", "max_tokens", "tool_use") and 0 < r.usage.output_tokens <= 8
        with client.messages.stream(max_tokens=8, extra_body={"temperature": 0}, **kw) as stream:
            final = stream.get_final_message()
        assert final.to_dict()["content"] == r.to_dict()["content"]
