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
    """Run a chunk of one sequence's prompt (positions start..) into its KV row; on the last
    chunk, also sample the first token."""

    request_id: str
    pages: list[int]  # the sequence's KV page table
    token_ids: list[int]
    start: int  # position of token_ids[0]: tokens before it are already in its pages
    last: bool  # the prompt's final chunk: sample
    params: SamplingParams
    reply: Any  # Reply[Sampled | None]
    # Linear-attention models (cache/state_anchors.py): the anchor whose saved state a sequence
    # resumed at `start` begins from, and the anchor to save once this chunk is in
    restore_anchor: bytes | None = None
    save_anchor: bytes | None = None


class DecodeStep(msgspec.Struct, kw_only=True):
    """One token for each running sequence, batched."""

    request_ids: list[str]
    page_tables: list[list[int]]
    tokens: list[int]  # each sequence's last token
    positions: list[int]  # where that token sits
    steps: list[int]  # tokens each sequence has generated so far (for routing traces)
    params: list[SamplingParams]
    reply: Any  # Reply[list[Sampled]]: one per sequence


class Release(msgspec.Struct):
    """A sequence finished: drop its sampling state."""

    request_id: str


class DropAnchors(msgspec.Struct):
    """The scheduler's anchor index evicted these anchors: drop their saved states."""

    keys: list[bytes]


class ResizeCaches(msgspec.Struct, kw_only=True):
    """Resize the expert slots and/or the KV cache (to the Scheduler, which applies it between
    steps through the GpuRunner). Replies the new status, or fails with RequestError."""

    moe_slots: int | None
    kv_tokens: int | None
    reply: Any


class ResizePools(msgspec.Struct, kw_only=True):
    """The Scheduler's resize order to the GpuRunner: the KV pool in pages, with the pages in
    use renumbered (old id -> new id)."""

    moe_slots: int | None
    kv_pages: int | None
    page_map: dict[int, int]
    reply: Any
