"""Hermes-style tool calls, as Qwen models write them:

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"zone": "CET"}}
    </tool_call>

Each well-formed call becomes a ToolCall as soon as its closing tag arrives. A call whose body
is not a `{"name", "arguments"}` object is passed on as text, tags included (the client sees
what the model wrote; nothing is lost). Whitespace that only separates calls from each other or
from the text is dropped. A call left open when the output ends (e.g. by a stop string) still
counts if its body is a complete call.
"""

from __future__ import annotations

from freetoken.server.parsers.base import (
    Event,
    TextDelta,
    ToolCall,
    partial_tag_len,
    tool_call_from_json,
    trailing_space_len,
)

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesToolParser:
    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._space_before_call = ""  # whitespace before an open tag: text again if the call is not one
        self._after_call = False  # drop whitespace right after a call
        self._calls = 0

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(CLOSE) :]
                self._close_call(out, body, closed=True)
                continue
            if self._after_call:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return out
                self._after_call = False
            at = self._buf.find(OPEN)
            if at < 0:
                break
            before, self._buf = self._buf[:at], self._buf[at + len(OPEN) :]
            space = trailing_space_len(before)
            self._text(out, before[: len(before) - space])
            self._space_before_call = before[len(before) - space :]
            self._in_call = True
        # Hold back a possible start of <tool_call>, and trailing whitespace (dropped if a call follows).
        hold = partial_tag_len(self._buf, (OPEN,))
        hold += trailing_space_len(self._buf[: len(self._buf) - hold])
        cut = len(self._buf) - hold
        self._text(out, self._buf[:cut])
        self._buf = self._buf[cut:]
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._in_call:
            self._close_call(out, self._buf, closed=False)
        elif self._buf.strip() or not self._calls:
            self._text(out, self._buf)
        self._buf = ""
        return out

    def _close_call(self, out: list[Event], body: str, *, closed: bool) -> None:
        self._in_call = False
        call = self.read_call(body)
        if call is None:
            self._text(out, self._space_before_call + OPEN + body + (CLOSE if closed else ""))
        else:
            out.append(call)
            self._calls += 1
            self._after_call = True
        self._space_before_call = ""

    def read_call(self, body: str) -> ToolCall | None:
        """The call a `<tool_call>` body holds; None when it is not one. The XML form (qwen_xml.py)
        shares the framing and reads its bodies differently."""
        return tool_call_from_json(body)

    @staticmethod
    def _text(out: list[Event], text: str) -> None:
        if text:
            out.append(TextDelta(text))
