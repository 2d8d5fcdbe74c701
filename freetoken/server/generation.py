"""What the API front ends (OpenAI, Anthropic) share about running one request: the prepared
request the app runs, prompt rendering, sampling parameters, the max_tokens budget, following
the engine's chunks to the end, and turning failures into API errors.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import anyio

from freetoken.config import SamplingParams
from freetoken.engine.protocol import LLM, CompletionChunk, TokenLogprob
from freetoken.errors import EngineError, RequestError
from freetoken.server.errors import ApiError, bad_request
from freetoken.server.parsers import (
    Family,
    Parser,
    ToolSchemas,
    family_of,
    make_parser,
    prompt_open_message,
    prompt_opens_reasoning,
    tool_schemas,
)

log = logging.getLogger("freetoken.server")

T = TypeVar("T")


class PreparedRequest(Protocol):
    """A validated request, ready for `llm.generate` (each API answers it with its own
    `respond` and `sse_events`, paired with its `prepare_*` in app.py)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool


# ----------------------------------------------------------------------------- preparing


async def off_loop(fn: Callable[[], T]) -> T:
    """Template rendering and tokenization run in a worker thread, off the event loop."""
    try:
        return await anyio.to_thread.run_sync(fn)
    except RequestError as exc:
        raise bad_request(str(exc), param=exc.param) from None


@dataclass(frozen=True)
class RenderedChat:
    text: str
    ids: list[int]


async def render_chat(
    llm: LLM,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    continue_final: bool = False,
    **template_kwargs: Any,
) -> RenderedChat:
    """The chat prompt as text and token ids. `continue_final`: the last message is an
    assistant turn to continue (its end-of-turn markup is cut off), not one to answer."""
    tokenizer = llm.tokenizer
    messages = [_with_object_arguments(message) for message in messages]

    def render() -> RenderedChat:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=not continue_final, tools=tools, **template_kwargs
        )
        if continue_final:
            final = str(messages[-1].get("content") or "").strip()
            at = text.rfind(final) if final else -1
            if at < 0:
                raise RequestError("the final assistant message cannot be continued", param="messages")
            text = text[: at + len(final)]
        return RenderedChat(text, tokenizer.encode(text, add_special_tokens=False))

    return await off_loop(render)


def _with_object_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its tool calls' arguments as objects where the client sent them as
    JSON text (OpenAI's form): templates walk the arguments (the XML form writes one block per
    parameter). Text that is not a JSON object stays text, for the template to take or refuse."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    decoded = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                value = json.loads(arguments)
            except ValueError:
                value = None
            if isinstance(value, dict):
                call = {**call, "function": {**function, "arguments": value}}
        decoded.append(call)
    return {**message, "tool_calls": decoded}


def resolve_max_tokens(
    requested: int | None, prompt_len: int, max_model_len: int, default_cap: int, *, prompt_param: str = "messages"
) -> int:
    """max_tokens for the engine: the request's, checked against the context window, or the
    rest of the window capped at `default_cap` when the request leaves it unset."""
    if prompt_len == 0:
        raise bad_request("The prompt is empty.", param="prompt")
    room = max_model_len - prompt_len
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt is "
            f"{prompt_len} tokens long, leaving no room for the completion. Shorten the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return min(room, default_cap)
    if requested > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, but {prompt_len + requested} "
            f"were requested ({prompt_len} in the prompt, {requested} for the completion). "
            "Reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def build_params(**fields: Any) -> SamplingParams:
    """Validated SamplingParams; a bad value is a 400 naming the parameter."""
    try:
        return SamplingParams(**fields).validate()
    except RequestError as exc:
        raise bad_request(str(exc), param=exc.param) from None


@dataclass(frozen=True)
class OutputParsing:
    """How a chat response's text is read: the model family's reasoning and tool-call syntax."""

    family: Family
    tools: bool  # tool calls are parsed (tools were offered and not switched off)
    starts_in_reasoning: bool  # the prompt left a <think> block open
    open_message: str = ""  # Harmony: the prompt's unfinished last message, which the output continues
    schemas: ToolSchemas = field(default_factory=dict)  # the tools' parameter schemas (they type XML calls)

    @classmethod
    def for_prompt(cls, llm: LLM, prompt_text: str, *, tools: list[dict[str, Any]] | None) -> OutputParsing:
        """`tools`: those the prompt offers (as the template took them), None when none are."""
        # The protocol does not promise an architecture; an engine that names it is trusted,
        # else the chat template tells the family.
        family = family_of(getattr(llm, "arch", None), getattr(llm.tokenizer, "chat_template", None))
        return cls(
            family,
            tools is not None,
            prompt_opens_reasoning(prompt_text),
            prompt_open_message(family, prompt_text),
            tool_schemas(tools),
        )

    @property
    def skip_special_tokens(self) -> bool:
        return not self.family.keeps_special_tokens(tools=self.tools)

    def new(self) -> Parser:
        return make_parser(
            self.family,
            tools=self.tools,
            starts_in_reasoning=self.starts_in_reasoning,
            open_message=self.open_message,
            schemas=self.schemas,
        )


# ----------------------------------------------------------------------------- running


def api_error_from(exc: BaseException) -> ApiError:
    """The response for an exception raised by the engine (or by us) while serving a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestError):
        return bad_request(str(exc), param=exc.param)
    if isinstance(exc, EngineError):
        log.error("the engine failed while serving a request: %s", exc)
        return ApiError(500, f"The engine failed while serving the request: {exc}", code="engine_error")
    log.error("unexpected error while serving a request", exc_info=exc)
    return ApiError(500, f"Internal server error ({type(exc).__name__}).", code="internal_error")


async def aclose_quietly(chunks: AsyncIterator[CompletionChunk] | None) -> None:
    """Close the engine's iterator (which cancels the request), even inside a cancelled scope."""
    aclose = getattr(chunks, "aclose", None)
    if aclose is None:
        return
    with anyio.CancelScope(shield=True):
        try:
            await aclose()
        except Exception:
            log.exception("closing a request's output stream failed")


async def follow(first: CompletionChunk, chunks: AsyncIterator[CompletionChunk]) -> AsyncIterator[CompletionChunk]:
    """The request's chunks up to the one with a finish reason. An engine failure (an error
    chunk, an exception, or the stream ending early) raises ApiError."""
    chunk = first
    while True:
        if chunk.finish_reason == "error":
            raise ApiError(500, f"The engine failed while serving the request: {chunk.error}", code="engine_error")
        yield chunk
        if chunk.finish_reason is not None:
            return
        try:
            chunk = await anext(chunks)
        except StopAsyncIteration:
            raise ApiError(500, "The engine ended the request without a finish reason.", code="engine_error") from None
        except Exception as exc:
            raise api_error_from(exc) from exc


@dataclass
class Collected:
    """A whole response, as the engine produced it."""

    parts: list[str] = field(default_factory=list)
    finish_reason: str = "stop"
    completion_tokens: int = 0
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, chunk: CompletionChunk) -> None:
        self.parts.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        self.completion_tokens = chunk.completion_tokens or len(self.token_ids)
        self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)  # reported once it is known
        if chunk.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason


async def collect(first: CompletionChunk, chunks: AsyncIterator[CompletionChunk]) -> Collected:
    """Run a request to its end; raises ApiError if the engine fails."""
    out = Collected()
    async with aclosing(follow(first, chunks)) as stream:
        async for chunk in stream:
            out.add(chunk)
    return out


def stop_token_ids(llm: LLM, params: SamplingParams) -> frozenset[int]:
    """Tokens that end a request without being part of its output."""
    eos = () if params.ignore_eos else tuple(getattr(llm.tokenizer, "eos_token_ids", ()) or ())
    return frozenset(params.stop_token_ids) | frozenset(eos)


def matched_stop(llm: LLM, params: SamplingParams, token_ids: list[int]) -> str | None:
    """Which stop string ended a request, or None. The engine leaves the match out of the text
    but not out of the tokens, and it stops at the earliest match: the earliest one in the
    decoded tokens is it."""
    if not params.stop:
        return None
    full = llm.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)
    hits = [(at, s) for s in params.stop if (at := full.find(s)) >= 0]
    return min(hits, key=lambda hit: hit[0])[1] if hits else None
