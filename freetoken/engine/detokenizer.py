"""Incremental detokenisation with stop strings.

Text is released as soon as it is final: a token that ends inside a multi-byte character
waits for the rest, and the tail that could still grow into a stop string is held back
until it cannot. A matched stop string and everything after it is never released.
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalText:
    def __init__(self, decoder: Decoder, stop: tuple[str, ...] = (), skip_special_tokens: bool = True) -> None:
        self._decoder = decoder
        self._skip_special = skip_special_tokens
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1  # chars that may start a stop string
        self._ids: list[int] = []
        self._text = ""  # decoded text of the tokens so far (complete characters only)
        self._released = 0  # chars of _text handed out
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append a token; return newly released text. Sets `stopped` on a stop-string match."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        text = self._decoder.decode(self._ids, skip_special_tokens=self._skip_special)
        if text.endswith("\ufffd"):  # an unfinished UTF-8 sequence: wait for the next token
            return ""
        self._text = text
        search_from = max(0, self._released - self._hold)
        cut = min((i for s in self._stop if (i := text.find(s, search_from)) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(cut)
        return self._release(len(text) - self._hold)

    def flush(self) -> str:
        """At the end of generation: release whatever was held back."""
        return "" if self.stopped else self._release(len(self._text))

    def _release(self, upto: int) -> str:
        if upto <= self._released:
            return ""
        out = self._text[self._released : upto]
        self._released = upto
        return out
