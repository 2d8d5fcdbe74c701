"""Output parsers (reasoning and tool calls) on hand-written model outputs.

Every case is checked one-shot (feed all, then finish) and streamed: split at every position,
one character at a time, and at random points (Hypothesis); the coalesced event streams must
be identical, whatever the split.
"""

from __future__ import annotations

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
    prompt_opens_reasoning,
)
from freetoken.server.parsers.base import JsonSpan, partial_tag_len

QWEN = FAMILIES["qwen3_moe"]
MIXTRAL = FAMILIES["mixtral"]

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'
WEATHER_CALL = ToolCall("get_weather", {"city": "Paris", "unit": "celsius"})
TIME_CALL = ToolCall("get_time", {"zone": "CET"})

# (id, family, tools, starts_in_reasoning, output, expected events)
CASES = [
    ("plain", QWEN, True, False, "The capital of France is Paris.\n", [TextDelta("The capital of France is Paris.\n")]),
    ("single-call", QWEN, True, False, f"<tool_call>\n{WEATHER}\n</tool_call>", [WEATHER_CALL]),
    (
        "two-calls",
        QWEN,
        True,
        False,
        f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
        [WEATHER_CALL, TIME_CALL],
    ),
    (
        "text-then-call",
        QWEN,
        True,
        False,
        f"I'll look that up for you.\n\n<tool_call>\n{WEATHER}\n</tool_call>\n",
        [TextDelta("I'll look that up for you."), WEATHER_CALL],
    ),
    (
        "think-then-call",
        QWEN,
        True,
        False,
        "<think>\nThe user wants the weather in Paris, so I call get_weather.\n</think>\n\n"
        f"<tool_call>\n{WEATHER}\n</tool_call>",
        [ReasoningDelta("The user wants the weather in Paris, so I call get_weather."), WEATHER_CALL],
    ),
    (
        "think-then-answer",
        QWEN,
        False,
        False,
        "<think>\nSimple arithmetic: 2 + 2 = 4.\n</think>\n\nThe answer is 4.",
        [ReasoningDelta("Simple arithmetic: 2 + 2 = 4."), TextDelta("The answer is 4.")],
    ),
    (
        "starts-in-reasoning",
        QWEN,
        False,
        False,
        "The user greets me; reply warmly.\n</think>\n\nHello! How can I help?",
        [TextDelta("The user greets me; reply warmly.\n</think>\n\nHello! How can I help?")],
    ),
    (
        "starts-in-reasoning-flag",
        QWEN,
        False,
        True,
        "The user greets me; reply warmly.\n</think>\n\nHello! How can I help?",
        [ReasoningDelta("The user greets me; reply warmly."), TextDelta("Hello! How can I help?")],
    ),
    ("empty-think", QWEN, True, False, "<think>\n\n</think>\n\nHi.", [TextDelta("Hi.")]),
    (
        "unfinished-think",
        QWEN,
        True,
        False,
        "<think>\nLet me count the letters: s, t, r",
        [ReasoningDelta("Let me count the letters: s, t, r")],
    ),
    (
        "call-inside-think-is-reasoning",
        QWEN,
        True,
        False,
        f"<think>\nMaybe <tool_call>{TIME}</tool_call>? No.\n</think>\n\nIt is noon.",
        [ReasoningDelta(f"Maybe <tool_call>{TIME}</tool_call>? No."), TextDelta("It is noon.")],
    ),
    (
        "malformed-json-is-text",
        QWEN,
        True,
        False,
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
        [TextDelta('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>')],
    ),
    (
        "not-a-call-object",
        QWEN,
        True,
        False,
        "<tool_call>[1, 2, 3]</tool_call> and <tool_call>{}</tool_call>",
        [TextDelta("<tool_call>[1, 2, 3]</tool_call> and <tool_call>{}</tool_call>")],
    ),
    (
        "tag-lookalikes",
        QWEN,
        True,
        False,
        "Use <tool> or <tool_cal or <thin> tags; a < b.",
        [TextDelta("Use <tool> or <tool_cal or <thin> tags; a < b.")],
    ),
    (
        "cut-off-call",
        QWEN,
        True,
        False,
        '<tool_call>\n{"name": "search", "arguments": {"q": "rus',
        [TextDelta('<tool_call>\n{"name": "search", "arguments": {"q": "rus')],
    ),
    (
        "unclosed-complete-call",
        QWEN,
        True,
        False,
        '<tool_call>\n{"name": "search", "arguments": {"q": "rust"}}\n',
        [ToolCall("search", {"q": "rust"})],
    ),
    (
        "string-arguments",
        QWEN,
        True,
        False,
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        [ToolCall("f", {"a": 1})],
    ),
    (
        "unicode-arguments",
        QWEN,
        True,
        False,
        '<tool_call>\n{"name": "search", "arguments": {"query": "Ünïcödé ✓ </tool"}}\n</tool_call>',
        [ToolCall("search", {"query": "Ünïcödé ✓ </tool"})],
    ),
    (
        "tools-off-keeps-calls-as-text",
        QWEN,
        False,
        False,
        f"<tool_call>\n{WEATHER}\n</tool_call>",
        [TextDelta(f"<tool_call>\n{WEATHER}\n</tool_call>")],
    ),
    ("mistral-plain", MIXTRAL, True, False, " Paris is the capital.", [TextDelta(" Paris is the capital.")]),
    ("mistral-array", MIXTRAL, True, False, f"[TOOL_CALLS] [{WEATHER}]", [WEATHER_CALL]),
    ("mistral-two", MIXTRAL, True, False, f"[TOOL_CALLS] [{WEATHER}, {TIME}]", [WEATHER_CALL, TIME_CALL]),
    ("mistral-no-space", MIXTRAL, True, False, f"[TOOL_CALLS][{WEATHER},{TIME}]", [WEATHER_CALL, TIME_CALL]),
    (
        "mistral-text-then-call",
        MIXTRAL,
        True,
        False,
        f"Let me check. [TOOL_CALLS] [{TIME}]",
        [TextDelta("Let me check."), TIME_CALL],
    ),
    (
        "mistral-args-form",
        MIXTRAL,
        True,
        False,
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
        [WEATHER_CALL, TIME_CALL],
    ),
    (
        "mistral-call-id",
        MIXTRAL,
        True,
        False,
        '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"zone": "CET"}',
        [TIME_CALL],
    ),
    (
        "mistral-malformed",
        MIXTRAL,
        True,
        False,
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}]',
        [TextDelta('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}]')],
    ),
    (
        "mistral-cut-off",
        MIXTRAL,
        True,
        False,
        f'[TOOL_CALLS] [{TIME}, {{"name": "get_weather", "argu',
        [TIME_CALL, TextDelta(', {"name": "get_weather", "argu')],
    ),
    (
        "mistral-marker-then-prose",
        MIXTRAL,
        True,
        False,
        "[TOOL_CALLS] sorry, no tool fits.",
        [TextDelta("[TOOL_CALLS] sorry, no tool fits.")],
    ),
]
IDS = [c[0] for c in CASES]


def _streamed(family, tools, starts, pieces) -> list:
    parser = make_parser(family, tools=tools, starts_in_reasoning=starts)
    events = []
    for piece in pieces:
        events.extend(parser.feed(piece))
    events.extend(parser.finish())
    return coalesce(events)


@pytest.mark.parametrize("name,family,tools,starts,text,expected", CASES, ids=IDS)
def test_one_shot(name, family, tools, starts, text, expected):
    assert parse_all(make_parser(family, tools=tools, starts_in_reasoning=starts), text) == expected


@pytest.mark.parametrize("name,family,tools,starts,text,expected", CASES, ids=IDS)
def test_split_anywhere(name, family, tools, starts, text, expected):
    assert _streamed(family, tools, starts, list(text)) == expected  # one character at a time
    for i in range(len(text) + 1):
        assert _streamed(family, tools, starts, [text[:i], text[i:]]) == expected, f"split at {i}"


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0), max_size=12))
def test_random_chunks(case, cuts):
    _, family, tools, starts, text, expected = case
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert _streamed(family, tools, starts, pieces) == expected


# Arbitrary text built from tag fragments: never raises, and the events never depend on the split.
_FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<think>", "</think>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<tool",
    "</thi", "[", "]", "{", "}", ",", '"', "\\", '"name"', ": ", '"f"', '"arguments"', "{}", " ", "\n", "x", "é",
]  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    parts=st.lists(st.sampled_from(_FRAGMENTS), max_size=30),
    cuts=st.lists(st.integers(min_value=0), max_size=8),
    family=st.sampled_from([QWEN, MIXTRAL]),
    starts=st.booleans(),
)
def test_arbitrary_text_is_split_invariant(parts, cuts, family, starts):
    text = "".join(parts)
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    one_shot = parse_all(make_parser(family, tools=True, starts_in_reasoning=starts), text)
    assert _streamed(family, True, starts, pieces) == one_shot
    assert _streamed(family, True, starts, list(text)) == one_shot


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_characters="<["), max_size=60))
def test_text_without_markup_passes_through(text):
    for family in (QWEN, MIXTRAL):
        events = parse_all(make_parser(family, tools=True), text)
        assert "".join(e.text for e in events) == text


def test_streaming_holds_back_partial_tags():
    parser = make_parser(QWEN, tools=True)
    assert parser.feed("Checking <tool_c") == [TextDelta("Checking")]
    assert parser.feed("all>") == []
    assert parser.feed(f"{TIME}</tool_call>") == [TIME_CALL]
    assert parser.finish() == []
    parser = make_parser(QWEN, tools=True)
    assert parser.feed("a <tool_c") == [TextDelta("a")]
    assert parser.feed("ar") == [TextDelta(" <tool_car")]


def test_call_is_reported_when_it_closes():
    parser = make_parser(MIXTRAL, tools=True)
    assert parser.feed(f"[TOOL_CALLS] [{WEATHER[:-1]}") == []
    assert parser.feed("}, ") == [WEATHER_CALL]
    assert parser.feed(TIME) == [TIME_CALL]
    assert parser.feed("]") == [] and parser.finish() == []


def test_family_registry():
    assert family_of("qwen3_moe") == family_of("qwen2_moe") == family_of("olmoe") == QWEN
    assert family_of("mixtral") == MIXTRAL and MIXTRAL.needs_special_tokens
    assert not QWEN.needs_special_tokens and QWEN.reasoning and not MIXTRAL.reasoning
    assert family_of(None, "{{ '[TOOL_CALLS] [' }}") == MIXTRAL  # guessed from the chat template
    assert family_of(None, {"default": "<tool_call>"}) == QWEN
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_helpers():
    assert partial_tag_len("abc <tool_c", ["<tool_call>"]) == 7
    assert partial_tag_len("abc <tool_call>", ["<tool_call>"]) == 0  # a whole tag is not partial
    assert partial_tag_len("x[TOOL", ["<tool_call>", "[TOOL_CALLS]"]) == 5
    span = JsonSpan()
    text = '{"a": "}{\\"", "b": [1, {"c": 2}]}'
    assert span.end(text[:10]) is None and span.end(text[:20]) is None
    assert span.end(text + " tail") == len(text)


def test_mixtral_marker_needs_special_tokens_in_the_text():
    from tokenizers import Tokenizer

    from freetoken.loader.tokenizer_builder import tokenizer_json_for

    tok = Tokenizer.from_str(tokenizer_json_for("mixtral"))
    ids = tok.encode(f"[TOOL_CALLS] [{TIME}]", add_special_tokens=False).ids
    kept = tok.decode(ids, skip_special_tokens=False)
    assert parse_all(make_parser(MIXTRAL, tools=True), kept) == [TIME_CALL]
    dropped = tok.decode(ids, skip_special_tokens=True)  # what the engine emits by default
    assert "[TOOL_CALLS]" not in dropped
    assert parse_all(make_parser(MIXTRAL, tools=True), dropped) == [TextDelta(dropped)]
