"""gpt-oss's Harmony format end to end: the official `openai` and `anthropic` clients against
the scripted fake engine, whose tokenizer renders the real Harmony template (loader/
chat_templates.py) and whose replies are Harmony text. Reasoning and a final answer, a tool
call, the tool result's turn, streamed and not; `reasoning_effort` reaching the prompt."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from freetoken.loader.chat_templates import HARMONY_TEMPLATE
from tests.fakes import FakeLLM, TemplateTokenizer
from tests.server_harness import running_server

ANSWER = "<|channel|>analysis<|message|>Simple sum.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4."
CALL = (
    "<|channel|>analysis<|message|>I need the weather.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
)
AFTER_TOOL = (
    "<|channel|>analysis<|message|>It is sunny.<|end|><|start|>assistant<|channel|>final<|message|>Sunny, 18 C."
)
OPENAI_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": "Current weather.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def srv():
    llm = FakeLLM(model_name="gpt-oss-fake", max_model_len=32768, arch="gpt_oss")
    llm.tokenizer = TemplateTokenizer(HARMONY_TEMPLATE)
    with running_server(llm) as s:
        yield s


@pytest.fixture(scope="module")
def oai(srv) -> openai.OpenAI:
    return srv.client()


@pytest.fixture(scope="module")
def claude(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=30)


def _prompt(srv, marker: str) -> str:
    return srv.llm.find(marker)[-1].prompt_text


# ----------------------------------------------------------------------------- OpenAI


def test_openai_reasoning_and_final(oai, srv):
    srv.llm.script("[[sum]]", ANSWER, ANSWER)
    kw = dict(model="gpt-oss-fake", messages=[{"role": "user", "content": "[[sum]] 2+2?"}], reasoning_effort="high")
    message = oai.chat.completions.create(**kw).choices[0].message
    assert message.content == "2 + 2 = 4." and message.model_extra["reasoning_content"] == "Simple sum."
    assert "\nReasoning: high\n" in _prompt(srv, "[[sum]]") and _prompt(srv, "[[sum]]").endswith("<|start|>assistant")
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == "2 + 2 = 4."
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "Simple sum."
    assert chunks[-1].choices[0].finish_reason == "stop"
    # The request's stop criteria keep the markup: special tokens stay in the engine's text.
    assert srv.llm.find("[[sum]]")[-1].params.skip_special_tokens is False


def test_openai_tool_call_and_result_turn(oai, srv):
    srv.llm.script("[[weather]]", CALL, CALL, AFTER_TOOL)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "[[weather]] Paris?"}]
    r = oai.chat.completions.create(model="gpt-oss-fake", messages=messages, tools=[OPENAI_TOOL])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "I need the weather."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    prompt = _prompt(srv, "[[weather]]")
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools" in prompt
    assert "type get_weather = (_: {\ncity: string,\n}) => any;" in prompt

    streamed = list(
        oai.chat.completions.create(model="gpt-oss-fake", messages=messages, tools=[OPENAI_TOOL], stream=True)
    )
    calls = [tc for c in streamed for tc in c.choices[0].delta.tool_calls or ()]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"

    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"})
    r = oai.chat.completions.create(model="gpt-oss-fake", messages=messages, tools=[OPENAI_TOOL])
    assert r.choices[0].message.content == "Sunny, 18 C." and r.choices[0].finish_reason == "stop"
    prompt = _prompt(srv, "18 C and sunny")
    assert (
        "<|start|>assistant<|channel|>analysis<|message|>I need the weather.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
        "<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>18 C and sunny<|end|>"
        "<|start|>assistant"
    ) in prompt


def test_openai_bad_reasoning_effort_is_a_400(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model="gpt-oss-fake", messages=[{"role": "user", "content": "hi"}], reasoning_effort="extreme"
        )
    assert "reasoning_effort" in str(err.value)


# ----------------------------------------------------------------------------- Anthropic


def test_anthropic_thinking_and_text(claude, srv):
    srv.llm.script("[[a-sum]]", ANSWER, ANSWER)
    kw = dict(
        model="gpt-oss-fake",
        max_tokens=4096,
        messages=[{"role": "user", "content": "[[a-sum]] 2+2?"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    r = claude.messages.create(**kw)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r.content] == [
        ("thinking", "Simple sum."),
        ("text", "2 + 2 = 4."),
    ]
    assert r.stop_reason == "end_turn" and "\nReasoning: low\n" in _prompt(srv, "[[a-sum]]")
    high = {"type": "enabled", "budget_tokens": 20000}
    events = list(claude.messages.create(stream=True, **{**kw, "max_tokens": 24000, "thinking": high}))
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == "Simple sum."
    assert "".join(d.text for d in deltas if d.type == "text_delta") == "2 + 2 = 4."
    assert "\nReasoning: high\n" in _prompt(srv, "[[a-sum]]")


def test_anthropic_tool_use_and_result_turn(claude, srv):
    srv.llm.script("[[a-weather]]", CALL, CALL, AFTER_TOOL)
    messages = [{"role": "user", "content": "[[a-weather]] Paris?"}]
    kw = dict(model="gpt-oss-fake", max_tokens=500, tools=[ANTHROPIC_TOOL])
    r = claude.messages.create(messages=messages, **kw)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["thinking", "tool_use"]
    use = r.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}

    events = list(claude.messages.create(messages=messages, stream=True, **kw))
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    partial = "".join(
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert starts == ["thinking", "tool_use"] and json.loads(partial) == {"city": "Paris"}

    messages.append({"role": "assistant", "content": [b.model_dump() for b in r.content]})
    messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]})
    r = claude.messages.create(messages=messages, **kw)
    assert [b.text for b in r.content if b.type == "text"] == ["Sunny, 18 C."] and r.stop_reason == "end_turn"
    prompt = _prompt(srv, "<|message|>18 C<|end|>")
    assert "<|start|>assistant<|channel|>analysis<|message|>I need the weather.<|end|>" in prompt
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>18 C<|end|>" in prompt
