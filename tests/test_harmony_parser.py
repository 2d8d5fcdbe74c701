"""The Harmony output parser (gpt-oss): hand-written outputs, and generated ones (Hypothesis),
each checked one-shot and streamed under every split: the coalesced events must not depend on
how the text arrived."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.server.parsers import (
    FAMILIES,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    coalesce,
    family_of,
    make_parser,
    parse_all,
)
from freetoken.server.parsers.harmony import HarmonyParser, open_message, read_header

GPT_OSS = FAMILIES["gpt_oss"]
GEN = "<|start|>assistant"  # the generation prompt's open message


def _analysis(text: str, *, first: bool = False) -> str:
    return ("" if first else GEN) + f"<|channel|>analysis<|message|>{text}<|end|>"


CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
WEATHER = ToolCall("get_weather", {"city": "Paris"})

# (id, tools, output, expected events)
CASES = [
    (
        "reasoning-final",
        True,
        _analysis("The user asks 2+2.", first=True) + "<|start|>assistant<|channel|>final<|message|>4.",
        [ReasoningDelta("The user asks 2+2."), TextDelta("4.")],
    ),
    (
        "final-with-return",
        True,
        "<|channel|>final<|message|>Done.<|return|>",
        [TextDelta("Done.")],
    ),
    (
        "call-stop-token-cut",
        True,
        _analysis("Need weather.", first=True) + CALL,
        [ReasoningDelta("Need weather."), WEATHER],
    ),
    (
        "call-with-call-tag",
        True,
        "<|channel|>analysis<|message|>x<|end|>" + CALL + "<|call|>",
        [ReasoningDelta("x"), WEATHER],
    ),
    (
        "recipient-in-role",
        True,
        "<|channel|>commentary<|message|>Checking.<|end|>"
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "CET"}<|call|>',
        [TextDelta("Checking."), ToolCall("get_time", {"zone": "CET"})],
    ),
    (
        "two-calls",
        True,
        CALL.removeprefix(GEN)
        + "<|call|>"
        + "<|start|>assistant<|channel|>commentary to=functions.get_time<|message|>{}<|call|>",
        [WEATHER, ToolCall("get_time", {})],
    ),
    (
        "arguments-not-json",
        True,
        "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{oops",
        [ToolCall("f", "{oops")],
    ),
    (
        "channel-without-end",  # a model that skips <|end|><|start|>assistant
        True,
        "<|channel|>analysis<|message|>hm<|channel|>final<|message|>ok",
        [ReasoningDelta("hm"), TextDelta("ok")],
    ),
    (
        "no-tools-call-is-text",
        False,
        "<|channel|>commentary to=functions.f<|message|>{}<|call|>",
        [TextDelta("<|channel|>commentary to=functions.f<|message|>{}<|call|>")],
    ),
    (
        "other-recipient-is-text",
        True,
        "<|channel|>analysis to=browser.search<|message|>{}<|call|>",
        [TextDelta("<|channel|>analysis to=browser.search<|message|>{}<|call|>")],
    ),
    (
        "unknown-channel-is-text",
        True,
        "<|channel|>aside<|message|>x<|end|>",
        [TextDelta("<|channel|>aside<|message|>x<|end|>")],
    ),
    ("one-word", True, "a", [TextDelta("a")]),
    ("plain-text", True, "Hello there, no markup.", [TextDelta("Hello there, no markup.")]),
    ("long-plain-text", True, "word " * 120, [TextDelta("word " * 120)]),
    ("cut-in-header", True, _analysis("a", first=True) + "<|start|>assistant<|channel|>fin", [ReasoningDelta("a")]),
    ("markup-like-body", True, "<|channel|>final<|message|>a <| b |> <|en", [TextDelta("a <| b |> <|en")]),
    ("empty", True, "", []),
]


def _streamed(parser, pieces) -> list:
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return coalesce(events + parser.finish())


def _assert_split_invariant(output: str, tools: bool, open_msg: str = GEN) -> list:
    whole = parse_all(HarmonyParser(tools=tools, open_message=open_msg), output)
    assert _streamed(HarmonyParser(tools=tools, open_message=open_msg), list(output)) == whole
    for at in range(len(output) + 1):
        pieces = [output[:at], output[at:]]
        assert _streamed(HarmonyParser(tools=tools, open_message=open_msg), pieces) == whole, at
    return whole


@pytest.mark.parametrize(("tools", "output", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_cases_one_shot_and_streamed(tools, output, expected):
    assert _assert_split_invariant(output, tools) == expected


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_random_splits(case, cuts):
    _, tools, output, _ = case
    bounds = sorted({min(c, len(output)) for c in cuts} | {0, len(output)})
    pieces = [output[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert _streamed(HarmonyParser(tools=tools, open_message=GEN), pieces) == parse_all(
        HarmonyParser(tools=tools, open_message=GEN), output
    )


# Bodies drawn from characters that spell the markup, so partial tags are common; a whole tag
# never appears in a body (special tokens are not text a body can hold).
_TAGS = ("<|end|>", "<|return|>", "<|call|>", "<|start|>", "<|channel|>", "<|message|>")
_BODY = st.text(alphabet="ab <|>endcal\n", max_size=16).filter(lambda s: not any(t in s for t in _TAGS))
_ARGS = st.dictionaries(st.sampled_from(["city", "n", "q"]), st.one_of(st.integers(), _BODY), max_size=3)
_MESSAGE = st.one_of(
    st.tuples(st.just("analysis"), _BODY),
    st.tuples(st.just("final"), _BODY),
    st.tuples(st.just("commentary"), _BODY),
    st.tuples(st.just("call"), st.tuples(st.sampled_from(["get_weather", "lookup"]), _ARGS)),
)


def _render(messages: list, close_last: bool) -> tuple[str, list]:
    """A model output of these messages and the events it must parse to."""
    text, expected = "", []
    for i, (kind, value) in enumerate(messages):
        head = "" if i == 0 else GEN
        last = i == len(messages) - 1
        if kind == "call":
            name, args = value
            text += f"{head}<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{json.dumps(args)}"
            text += "<|call|>" if close_last or not last else ""
            expected.append(ToolCall(name, args))
        else:
            text += f"{head}<|channel|>{kind}<|message|>{value}"
            text += ("<|return|>" if kind == "final" else "<|end|>") if close_last or not last else ""
            expected.append(ReasoningDelta(value) if kind == "analysis" else TextDelta(value))
    return text, coalesce(expected)


@settings(max_examples=80, deadline=None)
@given(
    messages=st.lists(_MESSAGE, min_size=1, max_size=5),
    close_last=st.booleans(),
    cuts=st.lists(st.integers(0, 2000), max_size=10),
)
def test_generated_outputs_parse_to_their_messages_under_any_split(messages, close_last, cuts):
    output, expected = _render(messages, close_last)
    assert parse_all(HarmonyParser(tools=True, open_message=GEN), output) == expected
    bounds = sorted({min(c, len(output)) for c in cuts} | {0, len(output)})
    pieces = [output[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert _streamed(HarmonyParser(tools=True, open_message=GEN), pieces) == expected


def test_open_message_of_the_prompt():
    prompt = "<|start|>user<|message|>hi<|end|><|start|>assistant"
    assert open_message(prompt) == GEN
    assert (
        open_message(prompt + "<|channel|>final<|message|>The answer is")
        == GEN + "<|channel|>final<|message|>The answer is"
    )
    assert open_message("<|start|>user<|message|>hi<|end|>") == ""
    assert open_message("no markup") == ""


def test_prefilled_final_message_continues_as_text():
    parser = HarmonyParser(tools=True, open_message=GEN + "<|channel|>final<|message|>The answer is")
    assert parse_all(parser, " 4.<|return|>") == [TextDelta(" 4.")]
    # A plain continuation of the generation prompt keeps none of the prompt's markup.
    assert parse_all(HarmonyParser(tools=True, open_message=GEN), "just text") == [TextDelta("just text")]


def test_read_header():
    assert read_header("<|channel|>analysis", tools=True) == ("reasoning", "")
    assert read_header("<|start|>assistant<|channel|>final", tools=True) == ("text", "")
    assert read_header("assistant to=functions.f<|channel|>commentary json", tools=True) == ("call", "f")
    assert read_header("<|channel|>commentary to=functions.f <|constrain|>json", tools=False) == ("raw", "")
    assert read_header("user<|channel|>final", tools=True) == ("raw", "")
    assert read_header("<|channel|>commentary to=functions.a to=functions.b", tools=True) == ("raw", "")


def test_gpt_oss_family_keeps_special_tokens_and_is_found_by_template():
    assert GPT_OSS.keeps_special_tokens(tools=False) and GPT_OSS.keeps_special_tokens(tools=True)
    assert not FAMILIES["qwen3_moe"].keeps_special_tokens(tools=True)
    assert FAMILIES["mixtral"].keeps_special_tokens(tools=True) and not FAMILIES["mixtral"].keeps_special_tokens(
        tools=False
    )
    assert family_of("gpt_oss") == GPT_OSS
    assert family_of(None, "{{ '<|start|>assistant<|channel|>final<|message|>' }}") == GPT_OSS
    parser = make_parser(GPT_OSS, tools=True, open_message=GEN)
    assert parse_all(parser, "<|channel|>analysis<|message|>r<|end|>") == [ReasoningDelta("r")]
