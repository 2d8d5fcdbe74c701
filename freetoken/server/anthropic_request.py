"""A validated /v1/messages request: what anthropic_api.py prepares and anthropic_output.py answers."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.config import SamplingParams
from freetoken.engine.protocol import LLM
from freetoken.server.generation import OutputParsing


@dataclass(frozen=True, kw_only=True)
class PreparedMessage:
    """A validated /v1/messages request, ready for `llm.generate` (a `PreparedRequest`)."""

    request_id: str
    created: int
    model: str
    llm: LLM
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    parsing: OutputParsing
