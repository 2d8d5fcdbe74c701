"""OpenAI response objects and SSE streams.

Chat output goes through the model family's parser (see server/parsers): `<think>` text
becomes `reasoning_content`, tool calls become `tool_calls` (finish_reason "tool_calls"),
and streaming sends the same pieces as deltas (`delta.reasoning_content`, and one
`delta.tool_calls` entry per call, whole, when the call closes). Legacy completions are
never parsed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from freetoken.engine.protocol import CompletionChunk, TokenLogprob
from freetoken.server.errors import ApiError
from freetoken.server.generation import Collected, aclose_quietly, collect, follow
from freetoken.server.logprobs import chat_logprobs, completion_logprobs, without_stop_token
from freetoken.server.openai_request import Prepared
from freetoken.server.parsers import ReasoningDelta, TextDelta, ToolCall, coalesce, parse_all
from freetoken.server.sse import json_data


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def tool_call_object(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """A `tool_calls` entry; `index` is set in streamed deltas."""
    args = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments, ensure_ascii=False)
    obj: dict[str, Any] = {} if index is None else {"index": index}
    obj["id"] = f"call_{uuid.uuid4().hex[:24]}"
    obj["type"] = "function"
    obj["function"] = {"name": call.name, "arguments": args}
    return obj


async def respond(p: Prepared, first: CompletionChunk, chunks: AsyncIterator[CompletionChunk]) -> dict[str, Any]:
    return final_response(p, await collect(first, chunks))


def final_response(p: Prepared, c: Collected) -> dict[str, Any]:
    """The non-streaming response object."""
    entries = without_stop_token(c.logprobs, c.token_ids, c.finish_reason, p.stop_ids)
    if p.kind == "chat":
        assert p.parsing is not None
        events = parse_all(p.parsing.new(), c.text)
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        calls = [tool_call_object(e) for e in events if isinstance(e, ToolCall)]
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        logprobs = None if p.tokens is None else {"content": chat_logprobs(entries, p.tokens), "refusal": None}
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": "tool_calls" if calls else c.finish_reason,
        }
        obj = "chat.completion"
    else:
        logprobs = None if p.tokens is None else completion_logprobs(entries, p.tokens, 0)[0]
        choice = {"index": 0, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}
        obj = "text_completion"
    return {
        "id": p.request_id,
        "object": obj,
        "created": p.created,
        "model": p.model,
        "choices": [choice],
        "usage": usage(len(p.prompt_ids), c.completion_tokens, c.cached_tokens),
    }


def _sse(data: Any) -> bytes:
    return b"data: " + json_data(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class _StreamWriter:
    """Builds the streamed objects of one request, chunk by chunk."""

    def __init__(self, p: Prepared) -> None:
        self.p = p
        self.object = "chat.completion.chunk" if p.kind == "chat" else "text_completion"
        self.parser = p.parsing.new() if p.parsing is not None else None
        self.tool_calls = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.offset = 0  # characters of output so far, for completion logprobs' text_offset

    def start(self) -> list[bytes]:
        return [self._chat({"role": "assistant", "content": ""})] if self.p.kind == "chat" else []

    def add(self, chunk: CompletionChunk) -> list[bytes]:
        self.completion_tokens = chunk.completion_tokens or self.completion_tokens + len(chunk.token_ids)
        self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)
        entries = without_stop_token(chunk.logprobs, chunk.token_ids, chunk.finish_reason, self.p.stop_ids)
        out = self._chat_pieces(chunk, entries) if self.parser is not None else self._text_piece(chunk, entries)
        if chunk.finish_reason is not None:
            if self.p.kind == "chat":
                out.append(self._chat({}, finish_reason="tool_calls" if self.tool_calls else chunk.finish_reason))
            else:
                out.append(self._completion("", finish_reason=chunk.finish_reason))
            if self.p.include_usage:
                usage_obj = usage(len(self.p.prompt_ids), self.completion_tokens, self.cached_tokens)
                out.append(self._wrap([], {"usage": usage_obj}))
            out.append(SSE_DONE)
        return out

    def _chat_pieces(self, chunk: CompletionChunk, entries: list[TokenLogprob]) -> list[bytes]:
        assert self.parser is not None
        events = self.parser.feed(chunk.text)
        if chunk.finish_reason is not None:
            events += self.parser.finish()
        lp = None if self.p.tokens is None else {"content": chat_logprobs(entries, self.p.tokens), "refusal": None}
        out = []
        for event in coalesce(events):
            if isinstance(event, TextDelta):
                delta: dict[str, Any] = {"content": event.text}
            elif isinstance(event, ReasoningDelta):
                delta = {"reasoning_content": event.text}
            else:
                delta = {"tool_calls": [tool_call_object(event, self.tool_calls)]}
                self.tool_calls += 1
            out.append(self._chat(delta, logprobs=lp))
            lp = None  # the logprobs of a chunk's tokens go out once
        if lp is not None and lp["content"]:
            out.append(self._chat({}, logprobs=lp))  # tokens whose text the parser holds back
        return out

    def _text_piece(self, chunk: CompletionChunk, entries: list[TokenLogprob]) -> list[bytes]:
        lp = None
        if self.p.tokens is not None and entries:
            lp, self.offset = completion_logprobs(entries, self.p.tokens, self.offset)
        return [self._completion(chunk.text, logprobs=lp)] if chunk.text or lp is not None else []

    def _chat(self, delta: dict[str, Any], *, logprobs: Any = None, finish_reason: str | None = None) -> bytes:
        return self._wrap([{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])

    def _completion(self, text: str, *, logprobs: Any = None, finish_reason: str | None = None) -> bytes:
        return self._wrap([{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}])

    def _wrap(self, choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> bytes:
        obj: dict[str, Any] = {
            "id": self.p.request_id,
            "object": self.object,
            "created": self.p.created,
            "model": self.p.model,
            "choices": choices,
        }
        if self.p.include_usage:
            obj["usage"] = None  # as OpenAI: null on every chunk but the last
        if extra:
            obj.update(extra)
        return _sse(obj)


async def sse_events(
    p: Prepared, first: CompletionChunk, chunks: AsyncIterator[CompletionChunk]
) -> AsyncIterator[bytes]:
    """The SSE byte stream of one request; closes the engine's iterator however it ends."""
    out = _StreamWriter(p)
    try:
        for data in out.start():
            yield data
        async with aclosing(follow(first, chunks)) as stream:
            async for chunk in stream:
                for data in out.add(chunk):
                    yield data
    except ApiError as exc:  # after the headers went out, errors travel in the stream
        yield _sse(exc.body())
    finally:
        await aclose_quietly(chunks)
