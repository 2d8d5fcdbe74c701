"""Harmony, the chat format of gpt-oss. Every message is a header and a body,

    <|start|>assistant<|channel|>analysis<|message|>They want the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

and the output continues the generation prompt's `<|start|>assistant`, so its first header is
just `<|channel|>analysis`. The analysis channel becomes ReasoningDelta; the final channel,
and commentary with no recipient (a preamble meant for the user), become TextDelta, streamed as
they arrive; a message to `functions.NAME` becomes a ToolCall when it ends (arguments: its JSON
object, else the text the model wrote). The recipient may also stand in the role part
(`<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`). `<|return|>`
and `<|call|>` are usually stop tokens and absent from the text; either ends a message when
present, as do `<|end|>` and the start of a next message.

A message that cannot be read - an unknown role or channel, another recipient, a tool call when
no tools were offered, more than one recipient - is passed on as text, markup included (the
client sees what the model wrote). So is text with no header: after `_MAX_HEADER` characters
without `<|message|>` they are text, and the search goes on after them.

The prompt's unfinished last message (`open_message`: its header, or header and prefilled body)
is read first, silently, so the parser starts where the output does.
"""

from __future__ import annotations

import json
from typing import Any

from freetoken.server.parsers.base import Event, ReasoningDelta, TextDelta, ToolCall, partial_tag_len

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
RETURN = "<|return|>"
CALL = "<|call|>"
# Tags that end a body. The first three are part of the message; the last two begin the next
# one (a model may skip `<|end|><|start|>assistant` and write `<|channel|>` straight away).
_CLOSERS = (END, RETURN, CALL)
_BODY_ENDS = (*_CLOSERS, START, CHANNEL)
_MESSAGE_ENDS = (*_CLOSERS, START)  # what ends the prompt's last message, if it is finished

CHANNELS = ("analysis", "commentary", "final")
FUNCTIONS = "functions."
_MAX_HEADER = 256

# How a message's body is read.
_REASONING, _TEXT, _CALL, _RAW = "reasoning", "text", "call", "raw"


def open_message(prompt_text: str) -> str:
    """The prompt's last message when it is unfinished (the generation prompt's
    `<|start|>assistant`, or a prefilled assistant message), else ''."""
    at = prompt_text.rfind(START)
    if at < 0:
        return ""
    tail = prompt_text[at:]
    return "" if any(tag in tail[len(START) :] for tag in _MESSAGE_ENDS) else tail


def read_header(header: str, *, tools: bool) -> tuple[str, str]:
    """(how the body is read, the tool name for a call) of a header: the text between a
    message's `<|start|>` (if any) and `<|message|>`."""
    text = header.strip()
    if text.startswith(START):
        text = text[len(START) :]
    role_part, has_channel, channel_part = text.partition(CHANNEL)
    role_words = role_part.split()
    channel_words = channel_part.replace(CONSTRAIN, " ").split()
    words = role_words + channel_words
    if any("<|" in word for word in words):
        return _RAW, ""
    recipients = [word[len("to=") :] for word in words if word.startswith("to=")]
    if any(word != "assistant" and not word.startswith("to=") for word in role_words) or len(recipients) > 1:
        return _RAW, ""
    channel = channel_words[0] if channel_words else ""
    if has_channel and channel not in CHANNELS:
        return _RAW, ""
    if recipients:
        name = recipients[0][len(FUNCTIONS) :] if recipients[0].startswith(FUNCTIONS) else ""
        return (_CALL, name) if tools and name else (_RAW, "")
    return (_REASONING if channel == "analysis" else _TEXT), ""


def _is_cut_header(text: str) -> bool:
    """Whether text is the start of a header and nothing else (the output ended inside it)."""
    if START not in text and CHANNEL not in text:
        return not text.strip()
    words = text.replace(START, " ").replace(CHANNEL, " ").replace(CONSTRAIN, " ").split()
    return all(
        word in ("assistant", "json") or word.startswith("to=") or any(c.startswith(word) for c in CHANNELS)
        for word in words
    )


def call_arguments(body: str) -> dict[str, Any] | str:
    """A call's arguments: the JSON object the body holds, else the body as the model wrote it."""
    try:
        value = json.loads(body)
    except ValueError:
        return body
    return value if isinstance(value, dict) else body


def _earliest(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """(index, tag) of the first of `tags` in text; (-1, '') when none is there."""
    best, found = -1, ""
    for tag in tags:
        at = text.find(tag)
        if at >= 0 and (best < 0 or at < best):
            best, found = at, tag
    return best, found


class HarmonyParser:
    def __init__(self, *, tools: bool, open_message: str = "") -> None:
        self._tools = tools
        self._buf = ""
        self._in_header = True
        self._kind = _TEXT
        self._name = ""
        self._raw_header = ""  # the header as written, for a message passed on as text
        self._from_prompt = 0  # leading characters of the buffer that are the prompt's
        if open_message:
            self.feed(open_message)  # the prompt's part: its events are not output
            if self._in_header:
                self._from_prompt = len(self._buf)
            elif self._kind in (_REASONING, _TEXT):
                self._buf = ""  # streamed text held back: the prompt's, not the output's

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._in_header:
            # A header cut off before its body says nothing; anything else is text.
            if not _is_cut_header(self._buf):
                _text(out, self._output_part(self._buf))
        else:
            self._end_body(out, self._buf, "")
        self._buf, self._in_header = "", True
        return out

    def _step(self, out: list[Event]) -> bool:
        """Advance by one decision; False when more text is needed. Every decision depends on
        the text alone, not on how much of it has arrived, so any split gives the same events."""
        buf = self._buf
        if self._in_header:
            at = buf.find(MESSAGE, 0, _MAX_HEADER + len(MESSAGE))
            if at < 0:
                if len(buf) < _MAX_HEADER + len(MESSAGE):
                    return False
                _text(out, self._output_part(buf[:_MAX_HEADER]))  # no header here: text
                self._buf = buf[_MAX_HEADER:]
                return True
            self._kind, self._name = read_header(buf[:at], tools=self._tools)
            self._raw_header = self._output_part(buf[: at + len(MESSAGE)])
            self._buf = buf[at + len(MESSAGE) :]
            self._in_header = False
            return True
        at, tag = _earliest(buf, _BODY_ENDS)
        if at < 0:
            if self._kind in (_REASONING, _TEXT):
                cut = len(buf) - partial_tag_len(buf, _BODY_ENDS)
                self._stream(out, buf[:cut])
                self._buf = buf[cut:]
            return False
        closer = tag if tag in _CLOSERS else ""
        self._buf = buf[at + len(closer) :]
        self._end_body(out, buf[:at], closer)
        self._in_header = True
        return True

    def _end_body(self, out: list[Event], body: str, closer: str) -> None:
        if self._kind == _CALL:
            out.append(ToolCall(self._name, call_arguments(body)))
        elif self._kind == _RAW:
            _text(out, self._raw_header + body + closer)
        else:
            self._stream(out, body)

    def _output_part(self, header_text: str) -> str:
        """Header text without the prompt's part of it (the prompt is not output)."""
        text, self._from_prompt = header_text[self._from_prompt :], 0
        return text

    def _stream(self, out: list[Event], text: str) -> None:
        if text:
            out.append(ReasoningDelta(text) if self._kind == _REASONING else TextDelta(text))


def _text(out: list[Event], text: str) -> None:
    if text:
        out.append(TextDelta(text))
