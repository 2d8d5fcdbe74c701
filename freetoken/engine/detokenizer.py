"""Incremental detokenisation with stop strings.

Text is released as soon as it is final: a token that ends inside a multi-byte character
waits for the rest, and the tail that could still grow into a stop string is held back
until it cannot. A matched stop string and everything after it is never released.

Each token costs decoding a few recent tokens, not the whole output: the new text is the
decoding of (previous chunk + new tokens) minus the decoding of the previous chunk, so
decoders that treat a sequence's first token specially (SentencePiece-style leading spaces)
still see context. Stop strings are searched for only in the new tail.
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
        self._boundary = 0  # ids before this index are decoded into _text (a character boundary)
        self._context = 0  # the boundary before that: decoding starts here, for context
        self._text = ""  # decoded text up to _boundary
        self._released = 0  # chars of _text handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self._decoder.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token_id: int) -> str:
        """Append a token; return newly released text. Sets `stopped` on a stop-string match."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        pending = self._pending()
        if pending.endswith("\ufffd"):  # an unfinished UTF-8 sequence: wait for the next token
            return ""
        search_from = max(0, min(self._released, len(self._text)) - self._hold)
        self._text += pending
        self._context, self._boundary = self._boundary, len(self._ids)
        cut = min((i for s in self._stop if (i := self._text.find(s, search_from)) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(cut)
        return self._release(len(self._text) - self._hold)

    def flush(self) -> str:
        """At the end of generation: release whatever was held back (an unfinished character
        decodes to the replacement character)."""
        if self.stopped:
            return ""
        self._text += self._pending()
        self._context, self._boundary = self._boundary, len(self._ids)
        return self._release(len(self._text))

    def _pending(self) -> str:
        """Text of the ids after the boundary, decoded with the chunk before it as context."""
        before = self._decode(self._ids[self._context : self._boundary])
        full = self._decode(self._ids[self._context :])
        if full.startswith(before):
            return full[len(before) :]
        return self._decode(self._ids[self._boundary :])  # the decoder rewrote the context: no context

    def _release(self, upto: int) -> str:
        if upto <= self._released:
            return ""
        out = self._text[self._released : upto]
        self._released = upto
        return out
