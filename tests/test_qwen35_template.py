"""The synthetic Qwen3.5 chat template (XML tool calls), rendered as the engine's tokenizer
renders templates, and read back by the family's output parser."""

from __future__ import annotations

import json

import jinja2
import pytest

from freetoken.loader.chat_templates import CHATML_TEMPLATE, QWEN3_5_TEMPLATE, chat_template_for
from freetoken.loader.tokenizer import _compile_template
from freetoken.server.parsers import (
    ReasoningDelta,
    TextDelta,
    ToolCall,
    family_of,
    make_parser,
    parse_all,
    prompt_opens_reasoning,
    tool_schemas,
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "where": {"type": "object"}},
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def render(messages, tools=None, add_generation_prompt=True, **kwargs) -> str:
    return _compile_template(QWEN3_5_TEMPLATE).render(
        messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
    )


def test_system_turn_lists_tools_as_json_then_the_system_prompt():
    tools = [WEATHER_TOOL, TIME_TOOL]
    text = render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], tools)
    head = "<|im_start|>system\n# Tools\n\n"
    listing = f"<tools>\n{json.dumps(WEATHER_TOOL)}\n{json.dumps(TIME_TOOL)}\n</tools>"
    assert text.startswith(head) and listing in text
    example = "<tool_call>\n<function=function_name>\n<parameter=parameter_name>\nvalue\n</parameter>\n</function>\n"
    assert example in text
    assert text.endswith("\n\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    plain = render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert plain.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")
    assert "<tools>" not in plain and not render([{"role": "user", "content": "hi"}]).startswith("<|im_start|>system")


def test_assistant_calls_and_tool_results():
    calls = [
        {"id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}},
        {"id": "c2", "function": {"name": "get_time", "arguments": {"where": {"tz": ["CET", 1]}}}},
    ]
    messages = [
        {"role": "user", "content": "Weather and time?"},
        {"role": "assistant", "content": "Both.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "noon"}]},
        {"role": "user", "content": "Thanks."},
    ]
    text = render(messages, [WEATHER_TOOL, TIME_TOOL], add_generation_prompt=False)
    assert (
        "<|im_start|>assistant\nBoth.\n\n"  # a turn before the last user message: no <think> block
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n<parameter=where>\n"
        '{"tz": ["CET", 1]}\n</parameter>\n</function>\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\nnoon\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nThanks.<|im_end|>\n"
    ) in text
    assert text.endswith("<|im_start|>user\nThanks.<|im_end|>\n")
    only_calls = render([{"role": "user", "content": "?"}, {"role": "assistant", "tool_calls": calls[:1]}])
    assert "<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>" in only_calls


def test_reasoning_and_enable_thinking():
    assert render([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n<think>\n")
    off = render([{"role": "user", "content": "hi"}], enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and not prompt_opens_reasoning(off)
    assert prompt_opens_reasoning(render([{"role": "user", "content": "hi"}], enable_thinking=True))
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "A.", "reasoning_content": "old thought"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "<think>\ninline thought\n</think>\n\nB."},
    ]
    text = render(messages, add_generation_prompt=False)
    assert "old thought" not in text and "<|im_start|>assistant\nA.<|im_end|>" in text  # before the last query
    assert text.endswith("<|im_start|>assistant\n<think>\ninline thought\n</think>\n\nB.<|im_end|>\n")


def test_bad_input_is_refused():
    with pytest.raises(jinja2.TemplateError, match="must be a JSON object"):
        call = {"function": {"name": "get_time", "arguments": "not json"}}
        render([{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": [call]}])
    with pytest.raises(jinja2.TemplateError, match="system message must come first"):
        render([{"role": "user", "content": "?"}, {"role": "system", "content": "late"}])
    with pytest.raises(jinja2.TemplateError, match="unsupported message role"):
        render([{"role": "narrator", "content": "?"}])


def test_a_turn_renders_as_its_prompt_plus_what_the_model_wrote():
    """What the model writes after the generation prompt, parsed and sent back as the assistant
    message, renders to the same text: the prompt stays a prefix of the next turn's."""
    tools = [WEATHER_TOOL, TIME_TOOL]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    output = (
        "The user wants the weather.\n</think>\n\nChecking.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
    )
    for thinking in (True, False):
        prompt = render(messages, tools, enable_thinking=thinking)
        written = output if thinking else output.split("</think>\n\n", 1)[1]
        family = family_of("qwen3_5_moe", QWEN3_5_TEMPLATE)
        parser = make_parser(
            family, tools=True, starts_in_reasoning=prompt_opens_reasoning(prompt), schemas=tool_schemas(tools)
        )
        events = parse_all(parser, written)
        calls = [e for e in events if isinstance(e, ToolCall)]
        assert calls == [ToolCall("get_weather", {"city": "Paris", "days": 2}), ToolCall("get_time", {})]
        assert [e.text for e in events if isinstance(e, TextDelta)] == ["Checking."]
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        assert reasoning == ("The user wants the weather." if thinking else "")
        reply = {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": reasoning,
            "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls],
        }
        again = render([*messages, reply], tools, add_generation_prompt=False)
        assert again == prompt + written + "<|im_end|>\n"


def test_template_for_the_family():
    assert chat_template_for("qwen3_5_moe") is chat_template_for("qwen3_5_moe_text") is QWEN3_5_TEMPLATE
    assert chat_template_for("qwen3_next") is CHATML_TEMPLATE  # Qwen3-Next writes Hermes JSON calls


def test_renders_as_transformers_renders_it():
    """The same text from transformers' own chat-template renderer, for every message kind."""
    from transformers.utils.chat_template_utils import render_jinja_template

    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
    parts = [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Oslo?"}]
    system = {"role": "system", "content": "Be brief."}
    conversations = [
        ([{"role": "user", "content": "hi"}], None, {}),
        ([system, {"role": "user", "content": "hi"}], None, {"enable_thinking": False}),
        (
            [
                system,
                {"role": "user", "content": parts},
                {"role": "assistant", "content": "Looking.", "reasoning_content": "Call it.", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c1", "content": "-3 C ☃ <b>"},
            ],
            [WEATHER_TOOL, TIME_TOOL],
            {"enable_thinking": True},
        ),
    ]
    for messages, tools, kwargs in conversations:
        for gen in (True, False):
            (theirs,), _ = render_jinja_template(
                [messages], tools=tools, chat_template=QWEN3_5_TEMPLATE, add_generation_prompt=gen, **kwargs
            )
            assert render(messages, tools, add_generation_prompt=gen, **kwargs) == theirs


def test_through_the_engine_tokenizer():
    """The engine's Tokenizer over the synthetic family's vocabulary: the template renders, a
    template error is a request error, and the call markup survives decoding with special
    tokens skipped (the engine's default), so the parser sees it."""
    from tokenizers import Tokenizer as FastTokenizer

    from freetoken.errors import RequestError
    from freetoken.loader.tokenizer import Tokenizer
    from freetoken.loader.tokenizer_builder import tokenizer_json_for

    tok = Tokenizer(
        FastTokenizer.from_str(tokenizer_json_for("qwen3_5_moe")),
        chat_template=chat_template_for("qwen3_5_moe"),
        special_tokens={"eos_token": "<|im_end|>"},
        eos_token_ids=(5,),
        bos_token_id=None,
    )
    prompt = tok.apply_chat_template([{"role": "user", "content": "Time?"}], tools=[TIME_TOOL])
    assert prompt_opens_reasoning(prompt) and tok.decode(tok.encode(prompt), skip_special_tokens=False) == prompt
    output = "Asked for the time.\n</think>\n\n<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n"
    output += "</function>\n</tool_call><|im_end|>"
    seen = tok.decode(tok.encode(output), skip_special_tokens=True)
    family = family_of("qwen3_5_moe", tok.chat_template)
    parser = make_parser(family, tools=True, starts_in_reasoning=True, schemas=tool_schemas([TIME_TOOL]))
    assert parse_all(parser, seen) == [ReasoningDelta("Asked for the time."), ToolCall("get_time", {"zone": "CET"})]
    bad = {"role": "assistant", "tool_calls": [{"function": {"name": "get_time", "arguments": "zone=CET"}}]}
    with pytest.raises(RequestError, match="must be a JSON object"):
        tok.apply_chat_template([{"role": "user", "content": "?"}, bad])
