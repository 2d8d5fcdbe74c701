"""The XML tool-call form of Qwen3.5 (server/parsers/qwen_xml.py), behind the `<think>` parser
as the server chains them. Every case is checked one-shot and streamed: split at every
position, one character at a time, and at random points (Hypothesis); the coalesced event
streams must be identical. Values are typed by the tools' JSON schemas."""

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
    tool_schemas,
)
from freetoken.server.parsers.qwen_xml import declared_kinds, read_xml_call, typed_value

QWEN35 = FAMILIES["qwen3_5_moe"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "detailed": {"type": "boolean"},
                    "units": {"enum": ["c", "f"]},
                    "where": {"type": "object"},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                    "ratio": {"type": ["number", "null"]},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
SCHEMAS = tool_schemas(TOOLS)


def call(name: str, **params: str) -> str:
    blocks = "".join(f"<parameter={p}>\n{v}\n</parameter>\n" for p, v in params.items())
    return f"<tool_call>\n<function={name}>\n{blocks}</function>\n</tool_call>"


WEATHER = call("get_weather", city="Paris", days="3")
WEATHER_CALL = ToolCall("get_weather", {"city": "Paris", "days": 3})
TIME = call("get_time", zone="CET")
TIME_CALL = ToolCall("get_time", {"zone": "CET"})
CUT = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
NESTED = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nA <b> c </function>\n</parameter>\n"
    "</function>\n</tool_call>"
)

# (id, output, expected events); tools offered, the prompt does not open <think>.
CASES = [
    ("plain", "Paris is the capital.\n", [TextDelta("Paris is the capital.\n")]),
    ("single", WEATHER, [WEATHER_CALL]),
    ("two-calls", f"{WEATHER}\n{TIME}", [WEATHER_CALL, TIME_CALL]),
    ("text-then-call", f"Let me check.\n\n{WEATHER}\n", [TextDelta("Let me check."), WEATHER_CALL]),
    ("call-then-text", f"{WEATHER}\nDone, then.", [WEATHER_CALL, TextDelta("Done, then.")]),
    (
        "think-then-calls",
        f"<think>\nTwo lookups.\n</think>\n\n{WEATHER}\n{TIME}",
        [ReasoningDelta("Two lookups."), WEATHER_CALL, TIME_CALL],
    ),
    (
        "call-inside-think-is-reasoning",
        f"<think>\nMaybe {TIME}?\n</think>\n\nNoon.",
        [ReasoningDelta(f"Maybe {TIME}?"), TextDelta("Noon.")],
    ),
    (
        "typed-values",
        call(
            "get_weather", city="3", days="7", detailed="true", units="c", where='{"lat": 1.5}', hours="[1, 2]",
            ratio="null",
        ),
        [
            ToolCall(
                "get_weather",
                {"city": "3", "days": 7, "detailed": True, "units": "c", "where": {"lat": 1.5}, "hours": [1, 2],
                 "ratio": None},
            )
        ],
    ),  # fmt: skip
    (
        "values-not-of-their-type-stay-text",
        call("get_weather", days="three", detailed="yes", ratio="NaN", hours="{}"),
        [ToolCall("get_weather", {"days": "three", "detailed": "yes", "ratio": "NaN", "hours": "{}"})],
    ),
    (
        "undeclared-stays-text",
        call("get_time", zone="7", extra="[1]"),
        [ToolCall("get_time", {"zone": "7", "extra": "[1]"})],
    ),
    ("unknown-function", call("lookup", q="rust"), [ToolCall("lookup", {"q": "rust"})]),
    ("no-parameters", "<tool_call>\n<function=get_time>\n</function>\n</tool_call>", [ToolCall("get_time", {})]),
    (
        "multiline-value",
        call("get_time", code="def f():\n    return 1\n"),
        [ToolCall("get_time", {"code": "def f():\n    return 1\n"})],
    ),
    (
        "inline-value",
        "<tool_call><function=get_time><parameter=zone>CET</parameter></function></tool_call>",
        [TIME_CALL],
    ),
    ("tags-inside-a-value", NESTED, [ToolCall("get_weather", {"city": "A <b> c </function>"})]),
    ("cut-off-call-is-text", CUT, [TextDelta(CUT)]),
    ("unclosed-complete-call", WEATHER[: -len("</tool_call>")], [WEATHER_CALL]),
    (
        "unclosed-parameter-is-text",
        "Hm.\n<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</function>\n</tool_call> ok",
        [TextDelta("Hm.\n<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</function>\n</tool_call> ok")],
    ),
    (
        "json-body-is-text",
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        [TextDelta('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')],
    ),
    (
        "bad-names-are-text",
        "<tool_call><function=get time></function></tool_call>"
        "<tool_call><function=f><parameter=>x</parameter></function></tool_call>",
        [
            TextDelta(
                "<tool_call><function=get time></function></tool_call>"
                "<tool_call><function=f><parameter=>x</parameter></function></tool_call>"
            )
        ],
    ),
    (
        "repeated-parameter-is-text",
        "<tool_call><function=f><parameter=a>1</parameter><parameter=a>2</parameter></function></tool_call>",
        [TextDelta("<tool_call><function=f><parameter=a>1</parameter><parameter=a>2</parameter></function></tool_call>")],
    ),
    (
        "two-functions-in-one-call-are-text",
        "<tool_call><function=f></function><function=g></function></tool_call>",
        [TextDelta("<tool_call><function=f></function><function=g></function></tool_call>")],
    ),
    (
        "bad-call-between-good-ones",
        f"{TIME}\n<tool_call>\n<function=f>\nloose text\n</function>\n</tool_call>\n{TIME}",
        [TIME_CALL, TextDelta("<tool_call>\n<function=f>\nloose text\n</function>\n</tool_call>"), TIME_CALL],
    ),
    (
        "lookalikes",
        "Use <tool> or <function=x> or <parameter tags; a < b.",
        [TextDelta("Use <tool> or <function=x> or <parameter tags; a < b.")],
    ),
]  # fmt: skip
IDS = [c[0] for c in CASES]


def _streamed(pieces: list[str], *, starts: bool = False) -> list:
    parser = make_parser(QWEN35, tools=True, starts_in_reasoning=starts, schemas=SCHEMAS)
    events = []
    for piece in pieces:
        events.extend(parser.feed(piece))
    events.extend(parser.finish())
    return coalesce(events)


def _one_shot(text: str, *, starts: bool = False) -> list:
    return parse_all(make_parser(QWEN35, tools=True, starts_in_reasoning=starts, schemas=SCHEMAS), text)


@pytest.mark.parametrize("name,text,expected", CASES, ids=IDS)
def test_one_shot(name, text, expected):
    assert _one_shot(text) == expected


@pytest.mark.parametrize("name,text,expected", CASES, ids=IDS)
def test_split_anywhere(name, text, expected):
    assert _streamed(list(text)) == expected  # one character at a time
    for i in range(len(text) + 1):
        assert _streamed([text[:i], text[i:]]) == expected, f"split at {i}"


def _pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0), max_size=12))
def test_random_chunks(case, cuts):
    _, text, expected = case
    assert _streamed(_pieces(text, cuts)) == expected


# Arbitrary text built from the form's fragments: never raises, never depends on the split,
# and what is not a call is never lost.
_FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<think>", "</think>", "<function=", "</function>", "<parameter=",
    "</parameter>", "get_time", "days", "zone", ">", "<", "\n", " ", "3", "true", "[1]", '{"a": 1}', "x", "é",
    "<tool", "</para", "<function=get_weather>", "<parameter=days>",
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.sampled_from(_FRAGMENTS), max_size=40),
    cuts=st.lists(st.integers(min_value=0), max_size=10),
    starts=st.booleans(),
)
def test_arbitrary_text_is_split_invariant(parts, cuts, starts):
    text = "".join(parts)
    one_shot = _one_shot(text, starts=starts)
    assert _streamed(_pieces(text, cuts), starts=starts) == one_shot
    assert _streamed(list(text), starts=starts) == one_shot
    if not any(isinstance(e, ToolCall) for e in one_shot) and "think>" not in text:
        assert "".join(e.text for e in one_shot).strip() == text.strip()


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(st.text(alphabet=st.characters(blacklist_characters="<"), max_size=12), min_size=1, max_size=3),
    lead=st.sampled_from(["", "Sure.\n", "<think>\nPlan.\n</think>\n\n"]),
    cuts=st.lists(st.integers(min_value=0), max_size=10),
)
def test_string_values_round_trip(values, lead, cuts):
    """Any text without `<` (the tags' start) is a string parameter's value exactly, however split."""
    params = {f"p{i}": v for i, v in enumerate(values)}
    text = lead + call("lookup", **params)
    events = _streamed(_pieces(text, cuts))
    assert events == _one_shot(text) and events[-1] == ToolCall("lookup", params)


def test_streaming_reports_a_call_when_it_closes():
    parser = make_parser(QWEN35, tools=True, schemas=SCHEMAS)
    assert parser.feed("Checking <tool_c") == [TextDelta("Checking")]
    assert parser.feed("all>\n<function=get_weather>\n<parameter=days>\n3\n</param") == []
    assert parser.feed("eter>\n</function>\n") == []
    assert parser.feed("</tool_call>") == [ToolCall("get_weather", {"days": 3})]
    assert parser.finish() == []


def test_without_tools_calls_stay_text():
    assert parse_all(make_parser(QWEN35, tools=False), WEATHER) == [TextDelta(WEATHER)]
    # no schemas given: every value stays text
    untyped = ToolCall("get_weather", {"city": "Paris", "days": "3"})
    assert parse_all(make_parser(QWEN35, tools=True), WEATHER) == [untyped]


def test_typing_rules():
    assert declared_kinds({"anyOf": [{"type": "integer"}, {"type": "null"}]}) == {"integer", "null"}
    assert declared_kinds({"enum": [1, "a"]}) == {"integer", "string"} and declared_kinds(None) == set()
    assert typed_value("5", {"type": "number"}) == 5 and typed_value("2.5", {"type": "number"}) == 2.5
    assert typed_value("4.0", {"type": "integer"}) == 4 and typed_value("4.5", {"type": "integer"}) == "4.5"
    assert typed_value("true", {"type": "integer"}) == "true"  # a boolean is not a number here
    assert typed_value("5", {"type": ["integer", "string"]}) == "5"  # a string fits: the text is kept
    assert typed_value("Infinity", {"type": "number"}) == "Infinity"
    assert typed_value(' {"a": [1]} ', {"type": "object"}) == {"a": [1]}
    assert read_xml_call("<function=f>\n</function>\n\n", {}) == ToolCall("f", {})
    assert read_xml_call("<function=f><parameter=a>1</parameter>", {}) is None  # no </function>


def test_tool_schemas():
    assert SCHEMAS["get_time"] == {} and set(SCHEMAS["get_weather"]) >= {"city", "days"}
    assert tool_schemas(None) == {} and tool_schemas([{"type": "function", "function": {"name": "f"}}]) == {"f": {}}


def test_family_selection():
    from freetoken.loader.chat_templates import CHATML_TEMPLATE, QWEN3_5_TEMPLATE

    assert family_of("qwen3_5_moe") == family_of("qwen3_5_moe_text") == QWEN35 and QWEN35.reasoning
    assert not QWEN35.keeps_special_tokens(tools=True)
    hermes = FAMILIES["qwen3_moe"]
    # Qwen3-Next and Qwen3 write JSON calls, unless the template says XML (their Coder models)
    assert family_of("qwen3_next", CHATML_TEMPLATE) == hermes
    assert family_of("qwen3_next", QWEN3_5_TEMPLATE) == family_of("qwen3_moe", QWEN3_5_TEMPLATE) == QWEN35
    assert family_of(None, QWEN3_5_TEMPLATE) == QWEN35 and family_of(None, {"default": QWEN3_5_TEMPLATE}) == QWEN35
    assert family_of("gpt_oss", QWEN3_5_TEMPLATE) == FAMILIES["gpt_oss"]  # only a Hermes family turns XML
