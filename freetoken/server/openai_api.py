"""The OpenAI-compatible API's requests: bodies, validation, and the prepared request.

Request bodies are decoded with msgspec straight into typed Structs, so a wrong type names the
offending field (`Expected `int`, got `str` - at `$.max_tokens``). Unknown fields are ignored
(clients send `user`, `metadata`, `store`, ...), but every known field we cannot honour
(penalties, n > 1, ...) is rejected with a 400 that says so, never silently dropped.
The responses are built in openai_output.py.

Defaults that differ from, or extend, the OpenAI API:
- `max_tokens` unset: the rest of the context window, capped at `DEFAULT_MAX_TOKENS`
  (configurable per app); a prompt plus an explicit `max_tokens` that do not fit in the
  context window is a 400, as with OpenAI.
- Extensions: `top_k` (0 or -1 = off), `ignore_eos`, `stop_token_ids`.
- Role `developer` is treated as `system`.
- Text content parts of a message are joined with newlines; other part types are a 400.
- `/v1/completions` tokenizes a string prompt with the tokenizer's special tokens (e.g. BOS);
  chat prompts come from the chat template, which adds its own.
- Tools: tool_choice "auto" (the default) and "none" only. The model's tool calls are parsed
  into `tool_calls`, its `<think>` text into `reasoning_content` (see server/parsers).
- Reasoning: `reasoning_effort` (low, medium, high) goes to the chat template, whose system
  message states it (Harmony's does; templates that take no effort ignore it); an assistant
  message's `reasoning_content`, sent back, goes to the template too (Harmony keeps it for the
  tool loop under way).
- logprobs: up to 20 alternatives per token (`top_logprobs`, or `logprobs` on completions).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, TypeVar

import msgspec

from freetoken.config import SamplingParams
from freetoken.engine.protocol import LLM
from freetoken.server.errors import ApiError, bad_request, cut, shown, unsupported
from freetoken.server.generation import (  # api_error_from: still imported from here by other modules
    OutputParsing,
    api_error_from,  # noqa: F401
    build_params,
    off_loop,
    render_chat,
    resolve_max_tokens,
    stop_token_ids,
)
from freetoken.server.logprobs import TokenStrings
from freetoken.server.openai_request import Prepared

DEFAULT_MAX_TOKENS = 4096
MAX_STOP_SEQUENCES = 4
MAX_TEMPERATURE = 2.0
MAX_TOP_LOGPROBS = 20
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
    reasoning_content: str | None = None  # as our responses carry it


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
    reasoning_effort: str | None = None


REASONING_EFFORTS = ("low", "medium", "high")


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
            f"The model `{cut(requested)}` does not exist; this server serves `{served}`.",
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
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", param="top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {req.top_logprobs}.",
                param="top_logprobs",
            )
    if req.response_format is not None and req.response_format.type != "text":
        raise unsupported(
            "response_format",
            f"response_format {shown(req.response_format.type)} is not supported; only 'text' is.",
        )
    if req.reasoning_effort is not None and req.reasoning_effort not in REASONING_EFFORTS:
        raise bad_request(
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {shown(req.reasoning_effort)}.",
            param="reasoning_effort",
        )
    choice = req.tool_choice
    if choice is not None and choice not in ("auto", "none"):
        named = shown(choice) if isinstance(choice, str) else "'a specific function'"
        raise unsupported("tool_choice", f"tool_choice {named} is not supported; use 'auto' or 'none'.")
    for i, tool in enumerate(req.tools or ()):
        if tool.type != "function":
            raise bad_request(
                f"tools[{i}].type must be 'function', got {shown(tool.type)}.", param=f"tools[{i}].type"
            )


def _check_completion(req: CompletionRequest) -> None:
    _check_common(req)
    if req.echo:
        raise unsupported("echo", "echo is not supported yet.")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {req.logprobs}.", param="logprobs")
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
                f"{where}.content[{j}]: content parts of type {shown(part.type)} are not supported; "
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
                f"{where}.role: unknown role {shown(msg.role)}; expected one of {', '.join(CHAT_ROLES)}.",
                param=f"{where}.role",
            )
        role = "system" if msg.role == "developer" else msg.role
        text = _message_text(msg.content, where)
        if text is None:
            if role != "assistant":
                raise bad_request(
                    f"{where}.content is required for role {shown(msg.role)}.", param=f"{where}.content"
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
        if msg.reasoning_content and role == "assistant":
            entry["reasoning_content"] = msg.reasoning_content
        out.append(entry)
    return out


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    # tool_choice "none" leaves the tools out of the prompt altogether (and calls are not
    # parsed): a model shown tools tends to call them whatever it is told.
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


def _sampling_params(req: _CommonRequest, max_tokens: int, **extra: Any) -> SamplingParams:
    top_k = req.top_k if req.top_k is not None else 0
    return build_params(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=0 if top_k == -1 else top_k,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        stop=_stop_strings(req.stop),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=bool(req.ignore_eos),
        **extra,
    )


# ----------------------------------------------------------------------------- prepared requests


async def prepare_chat(body: bytes, llm: LLM, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> Prepared:
    req = decode_request(body, ChatCompletionRequest)
    model = check_model(req.model, llm.model_name)
    _check_chat(req)
    tools = template_tools(req)
    effort = {"reasoning_effort": req.reasoning_effort} if req.reasoning_effort is not None else {}
    prompt = await render_chat(llm, template_messages(req.messages), tools, **effort)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(requested, len(prompt.ids), llm.max_model_len, default_max_tokens)
    parsing = OutputParsing.for_prompt(llm, prompt.text, tools=tools)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _sampling_params(
        req, max_tokens, logprobs=logprobs, skip_special_tokens=parsing.skip_special_tokens
    )
    return Prepared(
        kind="chat",
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=model,
        prompt_ids=prompt.ids,
        params=params,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        parsing=parsing,
        tokens=TokenStrings(llm.tokenizer) if logprobs is not None else None,
        stop_ids=stop_token_ids(llm, params),
    )


async def prepare_completion(body: bytes, llm: LLM, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> Prepared:
    req = decode_request(body, CompletionRequest)
    model = check_model(req.model, llm.model_name)
    _check_completion(req)
    tokenizer = llm.tokenizer
    prompt = completion_prompt(req.prompt, tokenizer.vocab_size)
    if isinstance(prompt, str):
        text = prompt
        prompt_ids = await off_loop(lambda: tokenizer.encode(text, add_special_tokens=True))
    else:
        prompt_ids = prompt
    max_tokens = resolve_max_tokens(
        req.max_tokens, len(prompt_ids), llm.max_model_len, default_max_tokens, prompt_param="prompt"
    )
    params = _sampling_params(req, max_tokens, logprobs=req.logprobs)
    return Prepared(
        kind="completion",
        request_id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=model,
        prompt_ids=prompt_ids,
        params=params,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        tokens=TokenStrings(tokenizer) if req.logprobs is not None else None,
        stop_ids=stop_token_ids(llm, params),
    )
