"""The OpenAI-compatible API: request bodies, validation, response objects, SSE streams.

Request bodies are decoded with msgspec straight into typed Structs, so a wrong type names the
offending field (`Expected `int`, got `str` - at `$.max_tokens``). Unknown fields are ignored
(clients send `user`, `metadata`, `store`, ...), but every known field we cannot honour
(penalties, logprobs, n > 1, ...) is rejected with a 400 that says so, never silently dropped.

Defaults that differ from, or extend, the OpenAI API:
- `max_tokens` unset: the rest of the context window, capped at `DEFAULT_MAX_TOKENS`
  (configurable per app); a prompt plus an explicit `max_tokens` that do not fit in the
  context window is a 400, as with OpenAI.
- Extensions: `top_k` (0 or -1 = off), `ignore_eos`, `stop_token_ids`.
- Role `developer` is treated as `system`.
- Text content parts of a message are joined with newlines; other part types are a 400.
- `/v1/completions` tokenizes a string prompt with the tokenizer's special tokens (e.g. BOS);
  chat prompts come from the chat template, which adds its own.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import anyio
import msgspec

from freetoken.config import SamplingParams
from freetoken.engine.protocol import LLM, CompletionChunk
from freetoken.errors import EngineError, RequestError
from freetoken.server.errors import ApiError, bad_request, error_body, unsupported

log = logging.getLogger("freetoken.server")

DEFAULT_MAX_TOKENS = 4096
MAX_STOP_SEQUENCES = 4
MAX_TEMPERATURE = 2.0
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


# ----------------------------------------------------------------------------- request bodies


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None


class _CommonRequest(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/chat/completions and /v1/completions. None = not given."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions (the names other OpenAI-compatible servers use).
    top_k: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(msgspec.Struct, kw_only=True):
    type: str
    function: FunctionDefinition


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str


class ChatCompletionRequest(_CommonRequest, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_CommonRequest, kw_only=True):
    # A string, a list of token ids, or a one-element list of either (msgspec unions allow
    # one array type, so the list forms are checked by hand).
    prompt: str | list[Any]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


RequestT = TypeVar("RequestT", ChatCompletionRequest, CompletionRequest)

_AT_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def decode_request(body: bytes, type_: type[RequestT]) -> RequestT:
    """Decode a JSON body into a request Struct; every failure is a 400 naming the problem."""
    if not body.strip():
        raise bad_request("The request body is empty; expected a JSON object.", code="invalid_json")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        path = (m.group(1) if (m := _AT_PATH.search(msg)) else "") or None
        if missing := _MISSING.search(msg):
            path = f"{path}.{missing.group(1)}" if path else missing.group(1)
        raise bad_request(f"Invalid request body: {msg}", param=path, code="invalid_value") from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}", code="invalid_json") from None


# ----------------------------------------------------------------------------- validation


def check_model(requested: str | None, served: str) -> str:
    if requested is not None and requested != served:
        raise ApiError(
            404,
            f"The model `{requested}` does not exist; this server serves `{served}`.",
            param="model",
            code="model_not_found",
        )
    return served


def _check_common(req: _CommonRequest) -> None:
    if req.n is not None and req.n != 1:
        raise unsupported("n", f"n={req.n} is not supported; only n=1 (one choice per request) is.")
    for name in ("presence_penalty", "frequency_penalty", "min_p"):
        value = getattr(req, name)
        if value is not None and value != 0:
            raise unsupported(name, f"{name} is not supported yet; omit it or set it to 0.")
    if req.repetition_penalty is not None and req.repetition_penalty != 1:
        raise unsupported(
            "repetition_penalty", "repetition_penalty is not supported yet; omit it or set it to 1."
        )
    if req.logit_bias:
        raise unsupported("logit_bias", "logit_bias is not supported yet.")
    if req.temperature is not None and not (0.0 <= req.temperature <= MAX_TEMPERATURE):
        raise bad_request(
            f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {req.temperature}.",
            param="temperature",
        )
    if req.top_p is not None and not (0.0 < req.top_p <= 1.0):
        raise bad_request(f"top_p must be in (0, 1], got {req.top_p}.", param="top_p")
    if req.top_k is not None and req.top_k < -1:
        raise bad_request(f"top_k must be >= 0 (0 or -1 = off), got {req.top_k}.", param="top_k")
    if req.seed is not None and not (INT64_MIN <= req.seed <= INT64_MAX):
        raise bad_request("seed must fit in a signed 64-bit integer.", param="seed")
    if req.max_tokens is not None and req.max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {req.max_tokens}.", param="max_tokens")
    stops = _stop_strings(req.stop)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad_request(
            f"stop accepts at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}.", param="stop"
        )
    if any(not s for s in stops):
        raise bad_request("stop sequences must be non-empty strings.", param="stop")


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _check_chat(req: ChatCompletionRequest) -> None:
    _check_common(req)
    if req.max_completion_tokens is not None:
        if req.max_completion_tokens < 1:
            raise bad_request(
                f"max_completion_tokens must be at least 1, got {req.max_completion_tokens}.",
                param="max_completion_tokens",
            )
        if req.max_tokens is not None and req.max_tokens != req.max_completion_tokens:
            raise bad_request(
                "max_tokens and max_completion_tokens disagree; send only max_completion_tokens.",
                param="max_tokens",
            )
    if req.logprobs:
        raise unsupported("logprobs", "logprobs are not supported yet.")
    if req.top_logprobs:
        raise unsupported("top_logprobs", "top_logprobs are not supported yet.")
    if req.response_format is not None and req.response_format.type != "text":
        raise unsupported(
            "response_format",
            f"response_format {req.response_format.type!r} is not supported; only 'text' is.",
        )
    choice = req.tool_choice
    if choice is not None and choice not in ("auto", "none"):
        shown = choice if isinstance(choice, str) else "a specific function"
        raise unsupported("tool_choice", f"tool_choice {shown!r} is not supported; use 'auto' or 'none'.")
    for i, tool in enumerate(req.tools or ()):
        if tool.type != "function":
            raise bad_request(
                f"tools[{i}].type must be 'function', got {tool.type!r}.", param=f"tools[{i}].type"
            )


def _check_completion(req: CompletionRequest) -> None:
    _check_common(req)
    if req.echo:
        raise unsupported("echo", "echo is not supported yet.")
    if req.logprobs is not None:
        raise unsupported("logprobs", "logprobs are not supported yet.")
    if req.best_of is not None and req.best_of != 1:
        raise unsupported("best_of", f"best_of={req.best_of} is not supported; only 1 is.")
    if req.suffix:
        raise unsupported("suffix", "suffix (insertion) is not supported.")


def _message_text(content: str | list[ContentPart] | None, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise bad_request(
                f"{where}.content[{j}]: content parts of type {part.type!r} are not supported; "
                "only 'text' parts are.",
                param=f"{where}.content[{j}].type",
            )
        if part.text is None:
            raise bad_request(
                f"{where}.content[{j}]: a text part needs 'text'.", param=f"{where}.content[{j}].text"
            )
        texts.append(part.text)
    return "\n".join(texts)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages as the plain dicts a chat template expects."""
    if not messages:
        raise bad_request("messages must contain at least one message.", param="messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if msg.role not in CHAT_ROLES:
            raise bad_request(
                f"{where}.role: unknown role {msg.role!r}; expected one of {', '.join(CHAT_ROLES)}.",
                param=f"{where}.role",
            )
        role = "system" if msg.role == "developer" else msg.role
        text = _message_text(msg.content, where)
        if text is None:
            if role != "assistant":
                raise bad_request(
                    f"{where}.content is required for role {msg.role!r}.", param=f"{where}.content"
                )
            text = ""  # an assistant turn that only calls tools
        entry: dict[str, Any] = {"role": role, "content": text}
        if msg.name is not None:
            entry["name"] = msg.name
        if msg.tool_calls:
            if role != "assistant":
                raise bad_request(
                    f"{where}.tool_calls is only allowed on assistant messages.", param=f"{where}.tool_calls"
                )
            entry["tool_calls"] = msg.tool_calls
        if role == "tool" and msg.tool_call_id is not None:
            entry["tool_call_id"] = msg.tool_call_id
        out.append(entry)
    return out


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    # Tools only reach the chat template (so the model knows about them); parsing the model's
    # tool calls back into `tool_calls` is not implemented yet, so calls come back as text.
    # tool_choice "none" leaves them out of the prompt altogether.
    if not req.tools or req.tool_choice == "none":
        return None
    return [msgspec.to_builtins(tool) for tool in req.tools]  # None fields are omitted


def completion_prompt(prompt: str | list[Any], vocab_size: int) -> str | list[int]:
    """A completions `prompt` as text or token ids; batched prompts are a 400."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
    elif prompt and all(isinstance(p, str) for p in prompt):
        raise bad_request(
            f"Batched prompts (a list of {len(prompt)} strings) are not supported; "
            "send one prompt per request.",
            param="prompt",
        )
    elif prompt and all(isinstance(p, list) for p in prompt):
        raise bad_request(
            f"Batched prompts (a list of {len(prompt)} token lists) are not supported; "
            "send one prompt per request.",
            param="prompt",
        )
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise bad_request("prompt must be a string or a list of token ids (integers).", param="prompt")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"prompt token id {bad} is out of range [0, {vocab_size}).", param="prompt")
    return list(prompt)


def _resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, default_cap: int) -> int:
    if prompt_len == 0:
        raise bad_request("The prompt is empty.", param="prompt")
    room = max_model_len - prompt_len
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt is "
            f"{prompt_len} tokens long, leaving no room for the completion. Shorten the prompt.",
            param="messages",
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


def _sampling_params(req: _CommonRequest, max_tokens: int) -> SamplingParams:
    top_k = req.top_k if req.top_k is not None else 0
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=0 if top_k == -1 else top_k,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        stop=_stop_strings(req.stop),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=bool(req.ignore_eos),
    )
    try:
        return params.validate()
    except RequestError as exc:
        raise bad_request(str(exc), param=exc.param) from None


# ----------------------------------------------------------------------------- prepared requests


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """A validated request, ready for `llm.generate`."""

    kind: Literal["chat", "completion"]
    request_id: str
    created: int
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool


async def prepare_chat(body: bytes, llm: LLM, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> Prepared:
    req = decode_request(body, ChatCompletionRequest)
    model = check_model(req.model, llm.model_name)
    _check_chat(req)
    messages = template_messages(req.messages)
    tools = template_tools(req)
    tokenizer = llm.tokenizer

    def render() -> list[int]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        return tokenizer.encode(text, add_special_tokens=False)

    prompt_ids = await _off_loop(render)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = _resolve_max_tokens(requested, len(prompt_ids), llm.max_model_len, default_max_tokens)
    return Prepared(
        kind="chat",
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=model,
        prompt_ids=prompt_ids,
        params=_sampling_params(req, max_tokens),
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
    )


async def prepare_completion(body: bytes, llm: LLM, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> Prepared:
    req = decode_request(body, CompletionRequest)
    model = check_model(req.model, llm.model_name)
    _check_completion(req)
    tokenizer = llm.tokenizer
    prompt = completion_prompt(req.prompt, tokenizer.vocab_size)
    if isinstance(prompt, str):
        text = prompt
        prompt_ids = await _off_loop(lambda: tokenizer.encode(text, add_special_tokens=True))
    else:
        prompt_ids = prompt
    max_tokens = _resolve_max_tokens(req.max_tokens, len(prompt_ids), llm.max_model_len, default_max_tokens)
    return Prepared(
        kind="completion",
        request_id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=model,
        prompt_ids=prompt_ids,
        params=_sampling_params(req, max_tokens),
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
    )


T = TypeVar("T")


async def _off_loop(fn: Callable[[], T]) -> T:
    """Template rendering and tokenization run in a worker thread, off the event loop."""
    try:
        return await anyio.to_thread.run_sync(fn)
    except RequestError as exc:
        raise bad_request(str(exc), param=exc.param) from None


# ----------------------------------------------------------------------------- running a request


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


@dataclass
class Outcome:
    text: str
    finish_reason: str
    completion_tokens: int


async def collect(first: CompletionChunk, chunks: AsyncIterator[CompletionChunk]) -> Outcome:
    """Run a request to its end; raises ApiError if the engine reports an error."""
    parts: list[str] = []
    counted = 0
    chunk = first
    while True:
        parts.append(chunk.text)
        counted += len(chunk.token_ids)
        if chunk.finish_reason == "error":
            raise ApiError(
                500, f"The engine failed while serving the request: {chunk.error}", code="engine_error"
            )
        if chunk.finish_reason is not None:
            return Outcome("".join(parts), chunk.finish_reason, chunk.completion_tokens or counted)
        try:
            chunk = await anext(chunks)
        except StopAsyncIteration:
            raise ApiError(
                500, "The engine ended the request without a finish reason.", code="engine_error"
            ) from None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def final_response(p: Prepared, outcome: Outcome) -> dict[str, Any]:
    """The non-streaming response object."""
    if p.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": outcome.text},
            "logprobs": None,
            "finish_reason": outcome.finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": outcome.text, "logprobs": None, "finish_reason": outcome.finish_reason}
        obj = "text_completion"
    return {
        "id": p.request_id,
        "object": obj,
        "created": p.created,
        "model": p.model,
        "choices": [choice],
        "usage": usage(len(p.prompt_ids), outcome.completion_tokens),
    }


def _sse(data: Any) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class _ChunkWriter:
    """Builds the streamed objects of one request."""

    def __init__(self, p: Prepared) -> None:
        self.p = p
        self.object = "chat.completion.chunk" if p.kind == "chat" else "text_completion"

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

    def choice(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> bytes:
        if self.p.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            body: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            body = {"index": 0, "text": text or ""}
        body["logprobs"] = None
        body["finish_reason"] = finish_reason
        return self._wrap([body])

    def usage(self, completion_tokens: int) -> bytes:
        return self._wrap([], {"usage": usage(len(self.p.prompt_ids), completion_tokens)})


async def sse_events(
    p: Prepared, first: CompletionChunk, chunks: AsyncIterator[CompletionChunk]
) -> AsyncIterator[bytes]:
    """The SSE byte stream of one request; closes the engine's iterator however it ends."""
    out = _ChunkWriter(p)
    counted = 0
    try:
        if p.kind == "chat":
            yield out.choice("", role=True)
        chunk = first
        while True:
            counted += len(chunk.token_ids)
            if chunk.text:
                yield out.choice(chunk.text)
            if chunk.finish_reason == "error":
                msg = f"The engine failed while serving the request: {chunk.error}"
                yield _sse(ApiError(500, msg, code="engine_error").body())
                return
            if chunk.finish_reason is not None:
                yield out.choice(None if p.kind == "chat" else "", chunk.finish_reason)
                if p.include_usage:
                    yield out.usage(chunk.completion_tokens or counted)
                yield SSE_DONE
                return
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                yield _sse(
                    error_body("The engine ended the request without a finish reason.", type="server_error")
                )
                return
            except Exception as exc:  # after the headers went out, errors travel in the stream
                yield _sse(api_error_from(exc).body())
                return
    finally:
        await aclose_quietly(chunks)
