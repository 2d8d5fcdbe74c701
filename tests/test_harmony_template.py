"""The Harmony chat template (gpt-oss), rendered as the engine's tokenizer renders templates."""

from __future__ import annotations

import jinja2
import pytest

from freetoken.loader.chat_templates import HARMONY_TEMPLATE, chat_template_for
from freetoken.loader.tokenizer import _compile_template
from freetoken.server.parsers import ReasoningDelta, TextDelta, ToolCall, parse_all
from freetoken.server.parsers.harmony import HarmonyParser, open_message

CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def render(messages, tools=None, add_generation_prompt=True, **kwargs) -> str:
    return _compile_template(HARMONY_TEMPLATE).render(
        messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
    )


def test_system_message_states_effort_and_channels():
    text = render([{"role": "user", "content": "hi"}])
    assert text.startswith("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n")
    assert "\nReasoning: medium\n\n# Valid channels: analysis, commentary, final." in text
    assert "developer" not in text and "functions" not in text  # no instructions, no tools
    assert text.endswith("<|end|><|start|>user<|message|>hi<|end|><|start|>assistant")
    assert "Reasoning: low" in render([{"role": "user", "content": "hi"}], reasoning_effort="low")
    with pytest.raises(jinja2.TemplateError, match="reasoning_effort"):
        render([{"role": "user", "content": "hi"}], reasoning_effort="max")


def test_tools_as_a_typescript_namespace():
    tool = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "What to look for"},
                    "limit": {"type": "integer", "default": 5},
                    "mode": {"enum": ["fast", "deep"]},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["query"],
            },
        },
    }
    text = render([{"role": "user", "content": "hi"}], tools=[tool, {"type": "function", "function": {"name": "now"}}])
    assert "Calls to these tools must go to the commentary channel: 'functions'.<|end|>" in text
    assert (
        "<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n"
        "// Search the web.\ntype search = (_: {\n// What to look for\nquery: string,\nlimit?: number, // default: 5\n"
        'mode?: "fast" | "deep",\ntags?: string[],\n}) => any;\n\ntype now = () => any;\n\n'
        "} // namespace functions<|end|>"
    ) in text


def test_history_keeps_only_the_reasoning_of_the_tool_loop_under_way():
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "old answer", "reasoning_content": "old thought"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "need a tool", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]
    text = render(messages)
    assert "old thought" not in text and "<|channel|>final<|message|>old answer<|end|>" in text
    assert (
        "<|start|>assistant<|channel|>analysis<|message|>need a tool<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
        "<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>18 C<|end|>"
        "<|start|>assistant"
    ) in text


def test_tool_message_must_name_its_call():
    messages = [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "missing", "content": "r"}]
    with pytest.raises(jinja2.TemplateError, match="tool_call_id"):
        render(messages)
    with pytest.raises(jinja2.TemplateError, match="roles must be"):
        render([{"role": "user", "content": "x"}, {"role": "system", "content": "late"}])


def test_rendered_assistant_turn_parses_back():
    """What the template writes for an assistant turn is what the parser reads from the model."""
    prompt = render([{"role": "user", "content": "q"}])
    turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL]}]
    written = render(turn, add_generation_prompt=False)[len(prompt) :]
    parser = HarmonyParser(tools=True, open_message=open_message(prompt))
    assert parse_all(parser, written.removesuffix("<|call|>")) == [
        TextDelta("Let me look."),
        ToolCall("get_weather", {"city": "Paris"}),
    ]
    final = render(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A.", "reasoning_content": "R"}],
        add_generation_prompt=False,
    )[len(prompt) :]
    assert parse_all(HarmonyParser(tools=True, open_message=open_message(prompt)), final) == [
        ReasoningDelta("R"),
        TextDelta("A."),
    ]


def test_the_synth_takes_it_by_family():
    assert chat_template_for("gpt_oss") is HARMONY_TEMPLATE
