"""Token log-probabilities as the OpenAI APIs show them.

The engine reports token ids; clients want each token's text and UTF-8 bytes. A token's text
is `decode([id])`, which for a piece of a multi-byte character is the replacement character,
so the bytes come from the vocabulary entry when possible: byte-level BPE entries spell bytes
with a printable alphabet, SentencePiece has `<0xHH>` byte tokens.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from freetoken.engine.protocol import TokenLogprob

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """The printable character byte-level BPE vocabularies use for each byte (GPT-2's scheme:
    printable Latin-1 bytes stand for themselves, the others take the code points from 256 on,
    in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class TokenStrings:
    """Text and bytes of token ids, cached (one per request: decoding is cheap, but a top-N
    list repeats tokens)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._lookup(token_id)
        return hit

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        # Special tokens are shown by name: they may be the output (Mixtral's [TOOL_CALLS]) or
        # a likely alternative (an end-of-turn token).
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        id_to_token = getattr(self._tokenizer, "id_to_token", None)
        raw = id_to_token(token_id) if id_to_token is not None else None
        if raw and raw.startswith("\u2581") and not text.startswith(" "):
            text = " " + text  # SentencePiece drops a word's leading space when decoded alone
        if "\ufffd" in text and raw:
            if m := _BYTE_TOKEN.fullmatch(raw):
                return text, [int(m.group(1), 16)]
            alphabet = byte_level_alphabet()
            if all(c in alphabet for c in raw):
                return text, [alphabet[c] for c in raw]
        return text, list(text.encode("utf-8"))


def without_stop_token(
    logprobs: list[TokenLogprob] | None, token_ids: list[int], finish_reason: str | None, stop_ids: frozenset[int]
) -> list[TokenLogprob]:
    """The entries for the output's tokens: a token that ended the request (EOS, a stop token)
    is not part of the output, so it has no entry, as with OpenAI."""
    entries = list(logprobs or ())
    if finish_reason == "stop" and token_ids and token_ids[-1] in stop_ids and len(entries) == len(token_ids):
        entries.pop()
    return entries


def chat_logprobs(entries: list[TokenLogprob], tokens: TokenStrings) -> list[dict[str, Any]]:
    """`choices[].logprobs.content` of a chat completion (or of one streamed chunk)."""
    out = []
    for entry in entries:
        text, raw = tokens.get(entry.token_id)
        top = []
        for token_id, logprob in entry.top:
            alt_text, alt_raw = tokens.get(token_id)
            top.append({"token": alt_text, "logprob": logprob, "bytes": alt_raw})
        out.append({"token": text, "logprob": entry.logprob, "bytes": raw, "top_logprobs": top})
    return out


def completion_logprobs(entries: list[TokenLogprob], tokens: TokenStrings, offset: int) -> tuple[dict[str, Any], int]:
    """`choices[].logprobs` of a legacy completion (or of one streamed chunk), and the offset
    after it. `offset`: where these tokens start, in characters from the start of the output."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        text, _ = tokens.get(entry.token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(entry.logprob)
        out["top_logprobs"].append({tokens.get(t)[0]: lp for t, lp in entry.top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset
