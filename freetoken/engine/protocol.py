"""What the serving front ends (HTTP server, CLI) see of the engine.

The engine is an actor system (see `freetoken/actors/`); front ends talk to it only through
this protocol, so an API handler never touches torch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Literal, Protocol

import msgspec

from freetoken.config import SamplingParams

if TYPE_CHECKING:
    from freetoken.loader.tokenizer import Tokenizer

FinishReason = Literal["stop", "length", "error"]


class CompletionChunk(msgspec.Struct, kw_only=True):
    """A piece of one request's output, in order. The last chunk has a finish_reason."""

    text: str  # text added since the previous chunk (a matched stop string is never included)
    token_ids: list[int]  # token ids added since the previous chunk
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far
    error: str | None = None  # set when finish_reason == "error"


class LLM(Protocol):
    model_name: str
    max_model_len: int
    tokenizer: Tokenizer

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[CompletionChunk]:
        """Stream a request's output. Raises RequestError before the first chunk for bad input
        (prompt too long, empty prompt, invalid params). Closing the iterator early cancels
        the request and frees its memory."""
        ...
