"""A validated chat or completion request: what openai_api.py prepares and openai_output.py answers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from freetoken.config import SamplingParams
from freetoken.server.generation import OutputParsing
from freetoken.server.logprobs import TokenStrings


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """A validated request, ready for `llm.generate` (a `PreparedRequest`)."""

    kind: Literal["chat", "completion"]
    request_id: str
    created: int
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    parsing: OutputParsing | None = None  # chat: how the output text is read
    tokens: TokenStrings | None = None  # set when logprobs were asked for
    stop_ids: frozenset[int] = frozenset()  # tokens that end the output without being part of it
