"""The incremental output-parser interface, its events, and helpers shared by the parsers.

A parser turns the model's raw output text into events: plain text, reasoning text, and tool
calls. Text arrives in arbitrary pieces (`feed`), and the end of the output is announced once
(`finish`). Streaming and one-shot responses use the same parser (one-shot = feed everything,
then finish), so both see the same events; a parser only decides about a piece of text once
no later text can change the decision, which makes the event stream independent of how the
text was split (after `coalesce`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] | str  # a JSON object, or the model's text when it was not one


Event = TextDelta | ReasoningDelta | ToolCall


class Parser(Protocol):
    def feed(self, text: str) -> list[Event]:
        """Consume more output; return the events that are now certain."""
        ...

    def finish(self) -> list[Event]:
        """The output has ended: return whatever was held back, decided as final."""
        ...


class PlainText:
    """No parsing: every piece of text is a TextDelta at once."""

    def feed(self, text: str) -> list[Event]:
        return [TextDelta(text)] if text else []

    def finish(self) -> list[Event]:
        return []


class Chain:
    """Reasoning first, then tool calls: the reasoning parser's text goes through the tool
    parser, so a tool call written while thinking stays part of the reasoning."""

    def __init__(self, reasoning: Parser, tools: Parser) -> None:
        self._reasoning = reasoning
        self._tools = tools

    def feed(self, text: str) -> list[Event]:
        return self._route(self._reasoning.feed(text))

    def finish(self) -> list[Event]:
        return [*self._route(self._reasoning.finish()), *self._tools.finish()]

    def _route(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            out.extend(self._tools.feed(event.text) if isinstance(event, TextDelta) else [event])
        return out


def parse_all(parser: Parser, text: str) -> list[Event]:
    """The one-shot result: the whole output at once, coalesced."""
    return coalesce([*parser.feed(text), *parser.finish()])


def coalesce(events: Iterable[Event]) -> list[Event]:
    """Merge neighbouring text (and neighbouring reasoning) events; drop empty ones."""
    out: list[Event] = []
    for event in events:
        if isinstance(event, TextDelta | ReasoningDelta):
            if not event.text:
                continue
            if out and type(out[-1]) is type(event):
                out[-1] = type(event)(out[-1].text + event.text)  # type: ignore[union-attr]
                continue
        out.append(event)
    return out


def partial_tag_len(text: str, tags: Iterable[str]) -> int:
    """Length of the longest end of `text` that is the start of a tag (but not a whole tag):
    the part to hold back until the next piece of text says whether a tag begins there."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def trailing_space_len(text: str) -> int:
    return len(text) - len(text.rstrip())


class JsonSpan:
    """Finds where a JSON object or array ends in text that grows at its end, resuming where
    the last scan stopped (a long argument list is not rescanned on every token). Only brackets
    and strings are tracked: whether the value is valid JSON is for json.loads to say."""

    def __init__(self) -> None:
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def end(self, text: str) -> int | None:
        """The index after the value that opens at text[0] ('{' or '['); None while incomplete."""
        for i in range(self._pos, len(text)):
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._pos = i + 1
                    return i + 1
        self._pos = len(text)
        return None


def tool_call_from_json(raw: str) -> ToolCall | None:
    """A `{"name": ..., "arguments": {...}}` object as a ToolCall; None when it is not one.
    Arguments given as a string holding a JSON object are decoded (some models double-encode)."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            decoded = json.loads(args)
        except ValueError:
            decoded = None
        args = decoded if isinstance(decoded, dict) else args
    if not isinstance(args, dict | str):
        return None
    return ToolCall(obj["name"], args)
