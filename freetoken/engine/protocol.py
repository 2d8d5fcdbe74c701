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


class TokenLogprob(msgspec.Struct, kw_only=True):
    """One generated token's log-probability and the most likely alternatives at its step
    (log-softmax of the model's raw logits, before temperature and filters)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []  # (token_id, logprob), most likely first


class CompletionChunk(msgspec.Struct, kw_only=True):
    """A piece of one request's output, in order. The last chunk has a finish_reason."""

    text: str  # text added since the previous chunk (a matched stop string is never included)
    token_ids: list[int]  # token ids added since the previous chunk
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far
    error: str | None = None  # set when finish_reason == "error"
    cached_tokens: int = 0  # prompt tokens whose KV was reused instead of prefilled
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when asked for


class LLM(Protocol):
    model_name: str
    arch: str  # the model family, e.g. "qwen3_moe" (tool-call and reasoning formats follow it)
    max_model_len: int
    tokenizer: Tokenizer

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[CompletionChunk]:
        """Stream a request's output. Raises RequestError before the first chunk for bad input
        (prompt too long, empty prompt, invalid params). Closing the iterator early cancels
        the request and frees its memory."""
        ...

    async def cache_status(self) -> dict:
        """The memory split and cache counters (policy, expert slots, KV tokens, hit rate, ...)."""
        ...

    async def resize_cache(self, moe_slots: int | None, kv_tokens: int | None) -> dict:
        """Resize the expert cache and/or the KV cache at the next safe point between steps.
        Raises RequestError for an impossible size, with the old caches intact; returns the
        new cache_status()."""
        ...

    def metrics(self) -> dict:
        """Counters and gauges for GET /metrics (see engine/metrics.py for the names)."""
        ...

    def recent_spans(self, limit: int) -> list[dict]:
        """The tracer's last `limit` spans, oldest first ({"track", "name", "start_ms", "dur_ms",
        "args"}; see trace/recorder.py); empty when the engine is not tracing."""
        ...

    def health(self) -> dict:
        """GET /health: {"status": "ok" | anything else, ...the engine's state}; cheap (no device
        sync, no wait behind a step), since load balancers poll it."""
        ...
