"""The Anthropic Messages API's requests: POST /v1/messages and /v1/messages/count_tokens.

A request is converted to the chat template's message list, as an OpenAI chat request would
be: `system` (a string or text blocks) becomes the first message, `tool_use` blocks become the
assistant's `tool_calls`, `tool_result` blocks become `role: "tool"` messages with a
`tool_call_id` (a result with `is_error` is prefixed "Error: ", as the template has no other
way to say so), and `thinking` blocks sent back become the assistant's `reasoning_content`
(templates decide whether to show it again: Harmony does for the tool loop under way). Tools
become OpenAI-style function tools. An assistant message at the end is continued rather than
answered (prefill).

Supported: tool_choice "auto" and "none" (the others are a 400); `thinking` {"type": "enabled"
| "disabled"} becomes the template's `enable_thinking` ("adaptive" leaves the template's
default), and a `reasoning_effort` for templates that take one (Harmony cannot switch
reasoning off): "disabled" is low, an "enabled" budget below 4096 tokens low, below 16384
medium, else high; `thinking.budget_tokens` is checked by Anthropic's rules (at least 1024,
below max_tokens) but does not cut the reasoning short: max_tokens bounds it, as the whole output;
`metadata` and unknown fields are ignored; image and document blocks are a 400.
Responses and streams are built in anthropic_output.py; errors are Anthropic-shaped
(`errors.ApiError.response` picks the shape by path).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from freetoken.engine.protocol import LLM
from freetoken.server.anthropic_request import PreparedMessage
from freetoken.server.errors import bad_request, shown, unsupported
from freetoken.server.generation import (
    OutputParsing,
    RenderedChat,
    build_params,
    render_chat,
    resolve_max_tokens,
)
from freetoken.server.openai_api import check_model, decode_request


class Block(msgspec.Struct, kw_only=True):
    """A content block; which fields matter depends on `type` (checked by hand, for clear errors)."""

    type: str
    text: str | None = None
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None


class InputMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Block]


class Tool(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent; Anthropic's server tools are not available here


class ToolChoice(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(msgspec.Struct, kw_only=True):
    type: str
    budget_tokens: int | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    model: str
    messages: list[InputMessage]
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None


# ----------------------------------------------------------------------------- validation


def _check_sampling(req: MessagesRequest) -> None:
    if req.max_tokens < 1:
        raise bad_request(f"max_tokens: must be at least 1, got {req.max_tokens}.", param="max_tokens")
    if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
        raise bad_request(f"temperature: must be between 0 and 1, got {req.temperature}.", param="temperature")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise bad_request(f"top_p: must be in (0, 1], got {req.top_p}.", param="top_p")
    if req.top_k is not None and req.top_k < 0:
        raise bad_request(f"top_k: must be >= 0, got {req.top_k}.", param="top_k")
    if any(not s for s in req.stop_sequences or ()):
        raise bad_request("stop_sequences: each stop sequence must be a non-empty string.", param="stop_sequences")


def _template_tools(req: CountTokensRequest) -> list[dict[str, Any]] | None:
    """The tools as the chat template takes them (OpenAI function tools); None when there are
    none or tool_choice is "none" (the model is not shown them, so it cannot call them)."""
    choice = req.tool_choice.type if req.tool_choice is not None else "auto"
    if choice not in ("auto", "none"):
        raise unsupported("tool_choice", f"tool_choice.type: {shown(choice)} is not supported; use 'auto' or 'none'.")
    out = []
    for i, tool in enumerate(req.tools or ()):
        if tool.type not in (None, "custom"):
            raise unsupported(f"tools[{i}].type", f"tools[{i}]: server tools ({shown(tool.type)}) are not supported.")
        if not tool.name:
            raise bad_request(f"tools[{i}].name: must be a non-empty string.", param=f"tools[{i}].name")
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        function["parameters"] = tool.input_schema if tool.input_schema is not None else {"type": "object"}
        out.append({"type": "function", "function": function})
    return out if out and choice == "auto" else None


def _text_of(blocks: list[Block] | list[dict[str, Any]], where: str) -> str:
    """The text of a list of text blocks (system, tool_result content)."""
    texts = []
    for j, block in enumerate(blocks):
        kind, text = (block.get("type"), block.get("text")) if isinstance(block, dict) else (block.type, block.text)
        if kind != "text" or not isinstance(text, str):
            raise bad_request(
                f"{where}[{j}]: only text blocks are supported here, got {shown(kind)}.", param=f"{where}[{j}]"
            )
        texts.append(text)
    return "\n".join(texts)


def _tool_result(block: Block, where: str) -> dict[str, Any]:
    if not block.tool_use_id:
        raise bad_request(f"{where}.tool_use_id: required on a tool_result block.", param=f"{where}.tool_use_id")
    content = block.content if isinstance(block.content, str) else _text_of(block.content or [], f"{where}.content")
    if block.is_error:
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}


def _tool_use(block: Block, where: str) -> dict[str, Any]:
    if not block.id or not block.name or block.input is None:
        raise bad_request(f"{where}: a tool_use block needs id, name and input.", param=where)
    return {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}}


_THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")
_UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "container_upload")


def template_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The request's system prompt and messages as the plain dicts a chat template expects."""
    out: list[dict[str, Any]] = []
    if req.system is not None:
        system = req.system if isinstance(req.system, str) else _text_of(req.system, "system")
        if system:
            out.append({"role": "system", "content": system})
    if not req.messages:
        raise bad_request("messages: at least one message is required.", param="messages")
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}]"
        if msg.role not in ("user", "assistant"):
            raise bad_request(
                f"{where}.role: must be 'user' or 'assistant', got {shown(msg.role)}.", param=f"{where}.role"
            )
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
            continue
        texts: list[str] = []
        thoughts: list[str] = []
        calls: list[dict[str, Any]] = []
        added = len(out)
        for j, block in enumerate(msg.content):
            at = f"{where}.content[{j}]"
            if block.type == "text" and block.text is not None:
                texts.append(block.text)
            elif block.type == "thinking" and msg.role == "assistant":
                thoughts.append(block.thinking or "")
            elif block.type == "redacted_thinking":
                continue  # encrypted by another server: nothing here can read it
            elif block.type == "tool_use" and msg.role == "assistant":
                calls.append(_tool_use(block, at))
            elif block.type == "tool_result" and msg.role == "user":
                if texts:  # keep the order of text and results
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                out.append(_tool_result(block, at))
            elif block.type in _UNSUPPORTED_BLOCKS:
                raise unsupported(f"{at}.type", f"{at}: {block.type} blocks are not supported; only text is.")
            else:
                raise bad_request(
                    f"{at}: a {shown(block.type)} block is not valid in a {msg.role} message here.", param=f"{at}.type"
                )
        if msg.role == "assistant":
            entry: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                entry["tool_calls"] = calls
            if any(thoughts):
                entry["reasoning_content"] = "\n".join(t for t in thoughts if t)
            out.append(entry)
        elif texts or len(out) == added:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


MIN_THINKING_BUDGET = 1024
# thinking.budget_tokens -> reasoning_effort: below the first bound low, below the second medium.
EFFORT_BOUNDS = (4096, 16384)


def reasoning_effort(thinking: Thinking) -> str | None:
    """The reasoning effort a thinking setting asks for; None leaves it to the template."""
    if thinking.type == "disabled":
        return "low"  # the least there is: Harmony models always reason
    if thinking.type != "enabled" or thinking.budget_tokens is None:
        return None
    low, medium = EFFORT_BOUNDS
    budget = thinking.budget_tokens
    return "low" if budget < low else "medium" if budget < medium else "high"


def _check_thinking(thinking: Thinking, max_tokens: int | None) -> None:
    """Anthropic's rules: "enabled" needs a budget_tokens of at least 1024 and below max_tokens
    (when the request has one; count_tokens has none); no other type takes a budget."""
    kind = thinking.type
    if kind not in _THINKING_TYPES:
        raise bad_request(
            f"thinking.type: must be one of {', '.join(_THINKING_TYPES)}, got {shown(kind)}.", param="thinking.type"
        )
    budget = thinking.budget_tokens
    if kind != "enabled":
        if budget is not None:
            raise bad_request(
                f"thinking.budget_tokens: only allowed with thinking.type 'enabled', not {shown(kind)}.",
                param="thinking.budget_tokens",
            )
        return
    if budget is None:
        raise bad_request("thinking.budget_tokens: required when thinking is enabled.", param="thinking.budget_tokens")
    if budget < MIN_THINKING_BUDGET:
        raise bad_request(
            f"thinking.budget_tokens: must be at least {MIN_THINKING_BUDGET}, got {budget}.",
            param="thinking.budget_tokens",
        )
    if max_tokens is not None and budget >= max_tokens:
        raise bad_request(
            f"thinking.budget_tokens: must be less than max_tokens ({max_tokens}), got {budget}.",
            param="thinking.budget_tokens",
        )


def _template_kwargs(req: CountTokensRequest) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if req.thinking is not None:
        kind = req.thinking.type
        _check_thinking(req.thinking, req.max_tokens if isinstance(req, MessagesRequest) else None)
        if kind in ("enabled", "disabled"):  # the others leave it to the model's template
            kwargs["enable_thinking"] = kind == "enabled"
            kwargs["reasoning_effort"] = reasoning_effort(req.thinking)
    return kwargs


def _continues(req: CountTokensRequest) -> bool:
    """Whether the request ends with an assistant message to continue (prefill)."""
    last = req.messages[-1] if req.messages else None
    if last is None or last.role != "assistant":
        return False
    if not isinstance(last.content, str) and any(b.type == "tool_use" for b in last.content):
        raise bad_request("messages: the final assistant message cannot contain tool_use blocks.", param="messages")
    return True


async def _render(req: CountTokensRequest, llm: LLM) -> tuple[RenderedChat, list[dict[str, Any]] | None]:
    check_model(req.model, llm.model_name)
    tools = _template_tools(req)
    prompt = await render_chat(
        llm, template_messages(req), tools, continue_final=_continues(req), **_template_kwargs(req)
    )
    return prompt, tools


# ----------------------------------------------------------------------------- prepared requests


async def prepare_messages(body: bytes, llm: LLM, default_max_tokens: int = 0) -> PreparedMessage:
    """A /v1/messages body, validated and rendered (max_tokens is required, so there is no default)."""
    req = decode_request(body, MessagesRequest)
    _check_sampling(req)
    prompt, tools = await _render(req, llm)
    max_tokens = resolve_max_tokens(req.max_tokens, len(prompt.ids), llm.max_model_len, req.max_tokens)
    parsing = OutputParsing.for_prompt(llm, prompt.text, tools=tools)
    params = build_params(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        stop=tuple(req.stop_sequences or ()),
        skip_special_tokens=parsing.skip_special_tokens,
    )
    return PreparedMessage(
        request_id=f"msg_{uuid.uuid4().hex}",
        created=int(time.time()),
        model=llm.model_name,
        llm=llm,
        prompt_ids=prompt.ids,
        params=params,
        stream=bool(req.stream),
        parsing=parsing,
    )


async def count_tokens(body: bytes, llm: LLM) -> dict[str, int]:
    """POST /v1/messages/count_tokens: the prompt's length, rendered exactly as /v1/messages would."""
    req = decode_request(body, CountTokensRequest)
    prompt, _ = await _render(req, llm)
    return {"input_tokens": len(prompt.ids)}
