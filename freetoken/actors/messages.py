"""Every message the actors exchange, as msgspec Structs.

Fields typed `Any` carry runtime objects (reply slots, output streams) that stay in-process;
everything else is plain data, so a message can be logged or traced as it is.
"""

from __future__ import annotations

from typing import Any

import msgspec

from freetoken.config import SamplingParams

# -- front end -> Scheduler ------------------------------------------------------------


class Submit(msgspec.Struct, kw_only=True):
    """A new request. `outbox` receives CompletionChunks; the last one has a finish_reason."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    outbox: Any


class Tick(msgspec.Struct):
    """The scheduler's note to itself: there is work, run the next step."""


# -- Scheduler -> GpuRunner ----------------------------------------------------------------


class PrefillStep(msgspec.Struct, kw_only=True):
    """Run one sequence's prompt into its KV row and sample its first token."""

    request_id: str
    row: int
    token_ids: list[int]
    params: SamplingParams
    reply: Any  # Reply[int]: the sampled token


class DecodeStep(msgspec.Struct, kw_only=True):
    """One token for each running sequence, batched."""

    request_ids: list[str]
    rows: list[int]
    tokens: list[int]  # each sequence's last token
    positions: list[int]  # where that token sits
    steps: list[int]  # tokens each sequence has generated so far (for routing traces)
    params: list[SamplingParams]
    reply: Any  # Reply[list[int]]: one sampled token per sequence


class Release(msgspec.Struct):
    """A sequence finished: drop its sampling state."""

    request_id: str


# -- status queries (step-level, never per layer) ------------------------------------------


class Status(msgspec.Struct):
    """Ask an actor for its counters and sizes; the reply is a plain dict."""

    reply: Any
