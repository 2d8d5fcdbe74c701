"""Anthropic Messages responses, SSE streams and errors.

The output text goes through the model family's parser (see server/parsers), as for OpenAI
chat: `<think>` text becomes `thinking` blocks (with an empty `signature`: there is nothing to
sign), the rest `text` blocks, tool calls `tool_use` blocks (stop_reason "tool_use"). A stream
sends message_start, then per block content_block_start / _delta (text_delta, thinking_delta,
input_json_delta: a call's whole input at once, when the call closes) / _stop, then
message_delta (stop_reason, usage) and message_stop. Usage follows Anthropic's accounting:
`input_tokens` + `cache_read_input_tokens` is the prompt.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from freetoken.engine.protocol import CompletionChunk
from freetoken.server.anthropic_request import PreparedMessage
from freetoken.server.errors import ApiError
from freetoken.server.generation import aclose_quietly, collect, follow, matched_stop
from freetoken.server.parsers import Event, ReasoningDelta, TextDelta, ToolCall, coalesce, parse_all
from freetoken.server.sse import json_data


def _tool_input(arguments: dict[str, Any] | str) -> dict[str, Any]:
    # Anthropic's input is always an object; arguments the model wrote as something else are
    # passed on whole rather than dropped.
    return arguments if isinstance(arguments, dict) else {"arguments": arguments}


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": f"toolu_{uuid.uuid4().hex[:24]}",
        "name": call.name,
        "input": _tool_input(call.arguments),
    }


def content_blocks(events: list[Event]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for event in coalesce(events):
        if isinstance(event, TextDelta):
            out.append({"type": "text", "text": event.text})
        elif isinstance(event, ReasoningDelta):
            out.append({"type": "thinking", "thinking": event.text, "signature": ""})
        else:
            out.append(_tool_use(event))
    return out


def stop_reason(
    p: PreparedMessage, finish_reason: str, token_ids: list[int], tool_calls: bool
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished response."""
    if tool_calls:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    stop = matched_stop(p.llm, p.params, token_ids)
    return ("stop_sequence", stop) if stop is not None else ("end_turn", None)


def usage(p: PreparedMessage, output_tokens: int, cached_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": len(p.prompt_ids) - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
    }


def _message(
    p: PreparedMessage, content: list[dict[str, Any]], reason: str | None, stop: str | None, use: dict
) -> dict:
    return {
        "id": p.request_id,
        "type": "message",
        "role": "assistant",
        "model": p.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop,
        "usage": use,
    }


async def respond(p: PreparedMessage, first: CompletionChunk, chunks: AsyncIterator[CompletionChunk]) -> dict[str, Any]:
    c = await collect(first, chunks)
    content = content_blocks(parse_all(p.parsing.new(), c.text))
    reason, stop = stop_reason(p, c.finish_reason, c.token_ids, any(b["type"] == "tool_use" for b in content))
    return _message(p, content, reason, stop, usage(p, c.completion_tokens, c.cached_tokens))


def _sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + json_data(event) + b"\n\n"


class _Blocks:
    """The content-block events of a stream: one block per run of text (or thinking), one per call."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the type of the open block
        self.tool_calls = 0

    def add(self, event: Event) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(event, ToolCall):
            block = _tool_use(event)
            out += self._start({**block, "input": {}})
            partial = json.dumps(block["input"], ensure_ascii=False)
            out.append(self._delta({"type": "input_json_delta", "partial_json": partial}))
            out += self.close()
            self.tool_calls += 1
            return out
        kind = "text" if isinstance(event, TextDelta) else "thinking"
        if self.open != kind:
            out += self.close()
            out += self._start(
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
        delta = (
            {"type": "text_delta", "text": event.text}
            if kind == "text"
            else {"type": "thinking_delta", "thinking": event.text}
        )
        out.append(self._delta(delta))
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_sse({"type": "content_block_stop", "index": self.index})]

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        self.index += 1
        self.open = block["type"]
        return [_sse({"type": "content_block_start", "index": self.index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _sse({"type": "content_block_delta", "index": self.index, "delta": delta})


async def sse_events(
    p: PreparedMessage, first: CompletionChunk, chunks: AsyncIterator[CompletionChunk]
) -> AsyncIterator[bytes]:
    """The SSE byte stream of one request; closes the engine's iterator however it ends."""
    parser = p.parsing.new()
    blocks = _Blocks()
    token_ids: list[int] = []
    cached = first.cached_tokens
    output_tokens = 0
    try:
        yield _sse({"type": "message_start", "message": _message(p, [], None, None, usage(p, 0, cached))})
        async with aclosing(follow(first, chunks)) as stream:
            async for chunk in stream:
                token_ids += chunk.token_ids
                output_tokens = chunk.completion_tokens or len(token_ids)
                cached = max(cached, chunk.cached_tokens)
                events = parser.feed(chunk.text)
                if chunk.finish_reason is not None:
                    events += parser.finish()
                for event in coalesce(events):
                    for data in blocks.add(event):
                        yield data
                if chunk.finish_reason is not None:
                    for data in blocks.close():
                        yield data
                    reason, stop = stop_reason(p, chunk.finish_reason, token_ids, blocks.tool_calls > 0)
                    yield _sse(
                        {
                            "type": "message_delta",
                            "delta": {"stop_reason": reason, "stop_sequence": stop},
                            "usage": usage(p, output_tokens, cached),
                        }
                    )
                    yield _sse({"type": "message_stop"})
    except ApiError as exc:  # after the headers went out, errors travel in the stream
        yield _sse(exc.anthropic_body())
    finally:
        await aclose_quietly(chunks)
