"""`<think>…</think>` reasoning, as Qwen3-style models write it.

Text inside a think block becomes ReasoningDelta, the rest TextDelta. The whitespace that
frames a block (the newline after `<think>`, before `</think>`, and the blank line after it)
is dropped, as chat templates add it back when the reasoning is sent again.

Some templates open `<think>` in the prompt itself, so the output starts inside the block:
`starts_in_reasoning=True` says so.
"""

from __future__ import annotations

from freetoken.server.parsers.base import Event, ReasoningDelta, TextDelta, partial_tag_len, trailing_space_len

OPEN = "<think>"
CLOSE = "</think>"


class ReasoningParser:
    def __init__(self, *, starts_in_reasoning: bool = False) -> None:
        self._inside = starts_in_reasoning
        self._buf = ""
        self._strip_leading = starts_in_reasoning  # drop whitespace before the next visible text

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if self._strip_leading:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return out
                self._strip_leading = False
            tag = CLOSE if self._inside else OPEN
            at = self._buf.find(tag)
            if at < 0:
                break
            before, self._buf = self._buf[:at], self._buf[at + len(tag) :]
            # Inside a block, the whitespace before </think> is framing: drop it.
            self._emit(out, before.rstrip() if self._inside else before)
            self._inside = not self._inside
            self._strip_leading = True
        # Hold back what may still become a tag, and (inside a block) trailing whitespace that
        # may turn out to precede </think>.
        hold = partial_tag_len(self._buf, (tag,))
        ready = self._buf[: len(self._buf) - hold]
        if self._inside:
            hold += trailing_space_len(ready)
        cut = len(self._buf) - hold
        self._emit(out, self._buf[:cut])
        self._buf = self._buf[cut:]
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        # An unclosed block (the output was cut short) keeps its text but not trailing whitespace.
        self._emit(out, self._buf.rstrip() if self._inside else self._buf)
        self._buf = ""
        return out

    def _emit(self, out: list[Event], text: str) -> None:
        if text:
            out.append(ReasoningDelta(text) if self._inside else TextDelta(text))
