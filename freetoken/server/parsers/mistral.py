"""Mistral-style tool calls. `[TOOL_CALLS]` is a special token, so the engine must decode with
skip_special_tokens=False for this parser to see it. Two forms:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}   (newer models)

(the newer form may carry `[CALL_ID]id` between the name and `[ARGS]`). Each call is reported
when its JSON object closes. What cannot be read as a call is passed on as text, from the point
where it stopped making sense; nothing is lost and nothing raises.
"""

from __future__ import annotations

from freetoken.server.parsers.base import (
    Event,
    JsonSpan,
    TextDelta,
    ToolCall,
    partial_tag_len,
    tool_call_from_json,
    trailing_space_len,
)

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_MAX_NAME = 256  # [ARGS] further than this after the marker: not a call

# States after the marker.
_TEXT, _START, _ARRAY, _NAME, _ARGS = "text", "start", "array", "name", "args"


class MistralToolParser:
    def __init__(self) -> None:
        self._buf = ""
        self._state = _TEXT
        self._raw = ""  # consumed call syntax not yet part of a reported call (text again if it fails)
        self._name = ""
        self._span: JsonSpan | None = None
        self._calls = 0

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._state == _TEXT:
            if self._buf.strip() or not self._calls:
                _text(out, self._buf)
        elif (self._raw + self._buf).strip():  # the output ended inside the call syntax
            _text(out, self._raw + self._buf)
        self._buf, self._raw, self._state, self._span = "", "", _TEXT, None
        return out

    def _step(self, out: list[Event]) -> bool:
        """Advance by one decision; False when more text is needed. Every decision depends on
        the text alone, never on how much of it has arrived, so any split gives the same events."""
        buf = self._buf
        if self._state == _TEXT:
            if self._calls:
                buf = self._buf = buf.lstrip()  # whitespace between calls
            at = buf.find(MARKER)
            if at < 0:
                hold = partial_tag_len(buf, (MARKER,))
                hold += trailing_space_len(buf[: len(buf) - hold])
                _text(out, buf[: len(buf) - hold])
                self._buf = buf[len(buf) - hold :]
                return False
            _text(out, buf[:at].rstrip())
            self._raw, self._buf, self._state = MARKER, buf[at + len(MARKER) :], _START
            return True
        if self._state in (_START, _ARRAY):
            rest = buf.lstrip(", \t\r\n" if self._state == _ARRAY else None)
            if not rest:
                return False
            self._raw += buf[: len(buf) - len(rest)]
            self._buf = rest
            if self._state == _START and rest[0] == "[":
                self._raw += "["
                self._buf, self._state = rest[1:], _ARRAY
                return True
            if self._state == _ARRAY and rest[0] == "]":
                self._buf, self._raw, self._state = rest[1:], "", _TEXT
                return True
            if rest[0] == "{":
                return self._object(out, rest, in_array=self._state == _ARRAY)
            if self._state == _START:
                self._state = _NAME
                return True
            return self._give_up(out)
        if self._state == _NAME:
            at = buf.find(ARGS, 0, _MAX_NAME + len(ARGS))
            if at < 0:
                return False if len(buf) < _MAX_NAME + len(ARGS) else self._give_up(out)
            name = buf[:at].split(CALL_ID, 1)[0].strip()
            if not name or any(c.isspace() for c in name):
                return self._give_up(out)
            self._name = name
            self._raw += buf[: at + len(ARGS)]
            self._buf, self._state = buf[at + len(ARGS) :], _ARGS
            return True
        # _ARGS: the JSON object of a [TOOL_CALLS]name[ARGS]{...} call.
        rest = buf.lstrip()
        if not rest:
            return False
        self._raw += buf[: len(buf) - len(rest)]
        self._buf = rest
        if rest[0] != "{":
            return self._give_up(out)
        return self._object(out, rest, in_array=False, name=self._name)

    def _object(self, out: list[Event], buf: str, *, in_array: bool, name: str | None = None) -> bool:
        if self._span is None:
            self._span = JsonSpan()
        end = self._span.end(buf)
        if end is None:
            return False
        self._span = None
        raw, self._buf = buf[:end], buf[end:]
        if name is None:
            call = tool_call_from_json(raw)
        else:
            wrapped = tool_call_from_json('{"name": "x", "arguments": ' + raw + "}")
            call = None if wrapped is None else ToolCall(name, wrapped.arguments)
        if call is None:
            self._buf = raw + self._buf
            return self._give_up(out)
        out.append(call)
        self._calls += 1
        self._raw = ""
        self._state = _ARRAY if in_array else _TEXT
        return True

    def _give_up(self, out: list[Event]) -> bool:
        """Not a call after all: the call syntax consumed so far is text, and the rest is read
        as text again (it may hold a later, well-formed call)."""
        _text(out, self._raw)
        self._raw, self._state, self._span = "", _TEXT, None
        return True


def _text(out: list[Event], text: str) -> None:
    if text:
        out.append(TextDelta(text))
