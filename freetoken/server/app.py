"""The HTTP app: Starlette routes over an `LLM` (run by `server/runner.py`). Routes:

    GET  /health                      the engine's state (`LLM.health`): 200 when its status is "ok", else 503
    GET  /v1/models, /v1/models/{id}  the one served model
    POST /v1/chat/completions         OpenAI chat completions (streaming or not)
    POST /v1/completions              OpenAI legacy completions (streaming or not)
    POST /v1/messages                 Anthropic messages (streaming or not; Anthropic-shaped errors)
    POST /v1/messages/count_tokens    Anthropic token counting
    GET  /dashboard                   the live dashboard (server/dashboard.py)

Every error under /v1/messages is in Anthropic's shape, every other one in OpenAI's, whether a
handler raised it or the router did (404 unknown route, 405 wrong method). Paths are matched as
they are: no trailing-slash redirects (a redirect would have to name a host, and the request's
Host header is the client's to choose). In front of the routes, `gate.Gate` checks the API key,
the content type and CORS; bodies are read through `body.read_json_body` (size, time, nesting).

A client that goes away cancels its request: the engine's iterator is closed as soon as the
disconnect is seen, whether the response is streamed or not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from freetoken.config import ServerConfig
from freetoken.engine.protocol import LLM, CompletionChunk
from freetoken.server import anthropic_output, openai_output
from freetoken.server.access_log import UsageNotes
from freetoken.server.admin_api import admin_routes
from freetoken.server.anthropic_api import count_tokens, prepare_messages
from freetoken.server.body import read_json_body
from freetoken.server.dashboard import dashboard_routes
from freetoken.server.errors import ApiError, json_response, shown
from freetoken.server.gate import Gate
from freetoken.server.generation import PreparedRequest, aclose_quietly, api_error_from
from freetoken.server.openai_api import DEFAULT_MAX_TOKENS, prepare_chat, prepare_completion

log = logging.getLogger("freetoken.server")

T = TypeVar("T")
P = TypeVar("P", bound=PreparedRequest)


@dataclass(frozen=True)
class _Generation(Generic[P]):
    """One generation endpoint: how its body becomes a prepared request, and how that is answered."""

    prepare: Callable[[bytes, LLM, int], Awaitable[P]]
    respond: Callable[[P, CompletionChunk, AsyncIterator[CompletionChunk]], Awaitable[Any]]
    events: Callable[[P, CompletionChunk, AsyncIterator[CompletionChunk]], AsyncIterator[bytes]]


_CHAT = _Generation(prepare_chat, openai_output.respond, openai_output.sse_events)
_COMPLETION = _Generation(prepare_completion, openai_output.respond, openai_output.sse_events)
_MESSAGES = _Generation(prepare_messages, anthropic_output.respond, anthropic_output.sse_events)


def build_app(
    llm: LLM,
    config: ServerConfig,
    *,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
) -> ASGIApp:
    """The ASGI app serving `llm` with the OpenAI and Anthropic APIs, behind its `Gate`.

    default_max_tokens: the cap on max_tokens when a request leaves it unset (the rest of the
        context window otherwise).
    """
    created = int(time.time())

    def model_card() -> dict[str, Any]:
        return {
            "id": llm.model_name,
            "object": "model",
            "created": created,
            "owned_by": "freetoken",
            "max_model_len": llm.max_model_len,
        }

    async def health_endpoint(request: Request) -> Response:
        try:
            body = dict(llm.health())
        except Exception as exc:
            log.exception("health check failed")
            return json_response({"status": "error", "error": f"health check failed: {exc}"}, status=503)
        body.setdefault("status", "ok")
        return json_response(body, status=200 if body["status"] == "ok" else 503)

    async def list_models(request: Request) -> Response:
        return json_response({"object": "list", "data": [model_card()]})

    async def get_model(request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id != llm.model_name:
            raise ApiError(
                404,
                f"The model {shown(model_id)} does not exist; this server serves `{llm.model_name}`.",
                param="model",
                code="model_not_found",
            )
        return json_response(model_card())

    async def chat_completions(request: Request) -> Response:
        return await _generate(request, llm, config, _CHAT, default_max_tokens)

    async def completions(request: Request) -> Response:
        return await _generate(request, llm, config, _COMPLETION, default_max_tokens)

    async def messages(request: Request) -> Response:
        return await _generate(request, llm, config, _MESSAGES, default_max_tokens)

    async def messages_count_tokens(request: Request) -> Response:
        return json_response(await count_tokens(await _read_body(request, config), llm))

    routes = [
        Route("/health", health_endpoint, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages_count_tokens, methods=["POST"]),
    ]
    routes += admin_routes(llm, config)  # /v1/cache/status, /v1/cache/resize, /metrics
    routes += dashboard_routes(llm)  # /dashboard and its snapshot and event stream
    app = Starlette(
        routes=routes,
        exception_handlers={
            ApiError: _api_error_handler,
            HTTPException: _http_error_handler,
            Exception: _internal_error_handler,
        },
    )
    app.router.redirect_slashes = False
    return Gate(app, config)


async def _read_body(request: Request, config: ServerConfig) -> bytes:
    return await read_json_body(
        request,
        limit=config.max_request_bytes,
        timeout_s=config.body_timeout_s,
        max_depth=config.max_json_depth,
    )


async def _api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response(request.url.path)


async def _http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {shown(request.url.path)}"
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        err = ApiError(404, f"Unknown route: {where}.", code="not_found")
    elif exc.status_code == 405:
        allowed = headers.get("Allow", headers.get("allow", ""))
        err = ApiError(405, f"Method not allowed: {where} (allowed: {allowed}).", code="method_not_allowed")
    else:
        err = ApiError(exc.status_code, f"{exc.detail} ({where}).")
    err.headers = headers or None
    return err.response(request.url.path)


async def _internal_error_handler(request: Request, exc: Exception) -> Response:
    err = ApiError(500, f"Internal server error ({type(exc).__name__}).", code="internal_error")
    return err.response(request.url.path)


async def _generate(
    request: Request,
    llm: LLM,
    config: ServerConfig,
    generation: _Generation,
    default_max_tokens: int,
) -> Response:
    try:
        body = await _read_body(request, config)
    except ClientDisconnect:
        return Response(status_code=499)  # nobody is listening
    p = await generation.prepare(body, llm, default_max_tokens)

    chunks: AsyncIterator[CompletionChunk] | None = None

    async def start() -> CompletionChunk:
        nonlocal chunks
        chunks = UsageNotes(llm.generate(p.prompt_ids, p.params, p.request_id), request.scope)
        return await anext(chunks)

    # Errors before the first chunk (the engine rejecting the request) are plain HTTP errors.
    try:
        disconnected, first = await _cancel_on_disconnect(request.receive, start)
    except StopAsyncIteration:
        await aclose_quietly(chunks)
        raise ApiError(500, "The engine produced no output for the request.", code="engine_error") from None
    except Exception as exc:
        await aclose_quietly(chunks)
        raise api_error_from(exc) from exc
    assert chunks is not None
    if disconnected or first is None:
        await aclose_quietly(chunks)
        return Response(status_code=499)

    if p.stream:
        return EventStreamResponse(generation.events(p, first, chunks))

    async def answer() -> Any:
        return await generation.respond(p, first, chunks)

    try:
        disconnected, outcome = await _cancel_on_disconnect(request.receive, answer)
    except Exception as exc:
        raise api_error_from(exc) from exc
    finally:
        await aclose_quietly(chunks)
    if disconnected or outcome is None:
        return Response(status_code=499)
    return json_response(outcome)


async def _cancel_on_disconnect(receive: Receive, fn: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """Run `fn`, cancelling it if the client disconnects: (disconnected, result)."""
    result: T | None = None
    error: BaseException | None = None
    disconnected = False
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal disconnected
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            result = await fn()
        except Exception as exc:  # re-raised below, unwrapped by the task group
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return disconnected, result


class EventStreamResponse(Response):
    """A server-sent-events response that stops (closing its event source) when the client leaves."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                await send(
                    {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
                )
                async for data in self.events:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
