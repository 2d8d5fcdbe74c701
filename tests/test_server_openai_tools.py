"""The OpenAI-compatible server's tool calls, reasoning and logprobs, over a real socket with the
official `openai` client (the fixtures and helpers of test_server_openai.py; as there, tests
that rely on the fake engine's scripted behaviour skip against another engine)."""

# ruff: noqa: F811 (the fixtures imported below come back as the tests' parameters, pytest's way)

from __future__ import annotations

import json

from tests.fakes import REPLY, FakeLLM
from tests.server_harness import running_server
from tests.test_server_openai import chat, client, fake, srv  # noqa: F401 (fixtures)

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
