"""Qwen3.5's XML tool calls end to end: the official `openai` and `anthropic` clients against the
scripted fake engine, whose tokenizer renders the synthetic Qwen3.5 template (loader/
chat_templates.py) and whose replies are what the family writes after it (the prompt opens
<think>). One-shot and streamed responses give the same calls, arguments typed by the tools'
schemas; the calls sent back render in the XML form, the results as <tool_response> turns."""

from __future__ import annotations

import json

import pytest

from freetoken.loader.chat_templates import QWEN3_5_TEMPLATE
from tests.fakes import FakeLLM, TemplateTokenizer
from tests.server_harness import running_server

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "hourly": {"type": "boolean"},
        "fields": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city"],
}
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast.", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
ANTHROPIC_TOOLS = [
    {"name": "get_weather", "description": "Forecast.", "input_schema": SCHEMA},
    {"name": "get_time", "input_schema": {"type": "object"}},
]
REPLY = (
    "Two lookups.\n</think>\n\nChecking.\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\n123 Main St\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n<parameter=hourly>\ntrue\n</parameter>\n<parameter=fields>\n[\"wind\", \"rain\"]\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\n1\n</parameter>\n</function>\n"
    "</tool_call>"
)
CALLS = [
    ("get_weather", {"city": "123 Main St", "days": 3, "hourly": True, "fields": ["wind", "rain"]}),
    ("get_time", {"zone": "1"}),  # no schema for it: the text
]


@pytest.fixture(scope="module")
def srv():
    llm = FakeLLM(model_name="qwen35-fake", max_model_len=32768, arch="qwen3_5_moe")
    llm.tokenizer = TemplateTokenizer(QWEN3_5_TEMPLATE)
    with running_server(llm) as s:
        yield s


def _prompt(srv, marker: str) -> str:
    return srv.llm.find(marker)[-1].prompt_text


# ----------------------------------------------------------------------------- OpenAI


def test_openai_calls_one_shot_and_streamed(srv):
    oai = srv.client()
    srv.llm.script("[[oai-calls]]", REPLY, REPLY)
    kw = dict(model="qwen35-fake", messages=[{"role": "user", "content": "[[oai-calls]] Weather?"}], tools=OPENAI_TOOLS)
    (choice,) = oai.chat.completions.create(**kw).choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert choice.message.model_extra["reasoning_content"] == "Two lookups."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == CALLS
    assert _prompt(srv, "[[oai-calls]]").endswith("[[oai-calls]] Weather?<|im_end|>\n<|im_start|>assistant\n<think>\n")

    chunks = list(oai.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Checking."
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "Two lookups."
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for tc in (tc for d in deltas for tc in d.tool_calls or ()):
        names[tc.index] = names.get(tc.index, "") + (tc.function.name or "")
        arguments[tc.index] = arguments.get(tc.index, "") + (tc.function.arguments or "")
    assert [(names[i], json.loads(arguments[i])) for i in sorted(names)] == CALLS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_openai_calls_sent_back_render_as_xml(srv):
    oai = srv.client()
    srv.llm.script("[[oai-trip]]", REPLY)
    messages = [{"role": "user", "content": "[[oai-trip]] Weather?"}]
    (choice,) = oai.chat.completions.create(model="qwen35-fake", messages=messages, tools=OPENAI_TOOLS).choices
    messages.append(choice.message.model_dump(exclude_none=True))  # arguments as JSON text, OpenAI's way
    for i, call in enumerate(choice.message.tool_calls):
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"result {i}"})
    oai.chat.completions.create(model="qwen35-fake", messages=messages, tools=OPENAI_TOOLS)
    prompt = _prompt(srv, "result 1")
    first = srv.llm.find("[[oai-trip]]")[0].prompt_text
    assert prompt.startswith(first + REPLY + "<|im_end|>\n")  # the turn renders as it was written
    assert (
        "<|im_start|>assistant\n<think>\nTwo lookups.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\n123 Main St\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=hourly>\ntrue\n"
        '</parameter>\n<parameter=fields>\n["wind", "rain"]\n</parameter>\n</function>\n</tool_call>\n'
    ) in prompt
    assert prompt.endswith(
        "<|im_start|>user\n<tool_response>\nresult 0\n</tool_response>\n<tool_response>\nresult 1\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def test_openai_without_tools_the_xml_is_text(srv):
    oai = srv.client()
    srv.llm.script("[[oai-none]]", REPLY)
    messages = [{"role": "user", "content": "[[oai-none]]"}]
    r = oai.chat.completions.create(model="qwen35-fake", messages=messages, tools=OPENAI_TOOLS, tool_choice="none")
    (choice,) = r.choices
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == REPLY.split("</think>\n\n", 1)[1]
    assert "# Tools" not in _prompt(srv, "[[oai-none]]")


# ----------------------------------------------------------------------------- Anthropic


def test_anthropic_tool_use_one_shot_and_streamed(srv):
    claude = srv.anthropic_client()
    srv.llm.script("[[claude-calls]]", REPLY, REPLY, REPLY)
    kw = dict(
        model="qwen35-fake", max_tokens=1000, tools=ANTHROPIC_TOOLS,
        messages=[{"role": "user", "content": "[[claude-calls]] Weather?"}],
    )  # fmt: skip
    r = claude.messages.create(**kw)
    assert r.stop_reason == "tool_use"
    assert [b.type for b in r.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert r.content[0].thinking == "Two lookups." and r.content[1].text == "Checking."
    assert [(b.name, b.input) for b in r.content[2:]] == CALLS

    events = list(claude.messages.create(stream=True, **kw))
    starts = {e.index: e.content_block for e in events if e.type == "content_block_start"}
    partial = {i: "" for i, b in starts.items() if b.type == "tool_use"}
    for e in events:
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta":
            partial[e.index] += e.delta.partial_json
    assert [(starts[i].name, json.loads(partial[i])) for i in sorted(partial)] == CALLS
    assert [e.delta.stop_reason for e in events if e.type == "message_delta"] == ["tool_use"]
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == CALLS


def test_anthropic_results_render_as_tool_responses(srv):
    claude = srv.anthropic_client()
    srv.llm.script("[[claude-trip]]", REPLY)
    messages = [{"role": "user", "content": "[[claude-trip]] Weather?"}]
    r = claude.messages.create(model="qwen35-fake", max_tokens=1000, tools=ANTHROPIC_TOOLS, messages=messages)
    uses = [b for b in r.content if b.type == "tool_use"]
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": f"out {u.name}"} for u in uses]
    messages += [{"role": "assistant", "content": r.content}, {"role": "user", "content": results}]
    claude.messages.create(model="qwen35-fake", max_tokens=50, tools=ANTHROPIC_TOOLS, messages=messages)
    prompt = _prompt(srv, "out get_time")
    assert prompt.startswith(srv.llm.find("[[claude-trip]]")[0].prompt_text + REPLY + "<|im_end|>\n")
    assert "<|im_start|>assistant\n<think>\nTwo lookups.\n</think>\n\nChecking.\n\n<tool_call>\n" in prompt
    time_call = "<tool_call>\n<function=get_time>\n<parameter=zone>\n1\n</parameter>\n</function>\n</tool_call>"
    assert time_call + "<|im_end|>" in prompt
    assert (
        "<|im_start|>user\n<tool_response>\nout get_weather\n</tool_response>\n<tool_response>\nout get_time\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    ) in prompt
