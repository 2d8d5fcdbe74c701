"""The HTTP server: a Starlette app over an `LLM`, run by uvicorn.

    async with engine as llm:                       # anything that yields an LLM
        await serve(llm, ServerConfig(port=8000))   # until SIGINT / SIGTERM

or, synchronously, `run(engine, config)`. Routes:

    GET  /health                      200 {"status": "ok"}, 503 when the health callback says so
    GET  /v1/models, /v1/models/{id}  the one served model
    POST /v1/chat/completions         OpenAI chat completions (streaming or not)
    POST /v1/completions              OpenAI legacy completions (streaming or not)
    POST /v1/messages                 Anthropic messages (streaming or not; Anthropic-shaped errors)
    POST /v1/messages/count_tokens    Anthropic token counting

A client that goes away cancels its request: the engine's iterator is closed as soon as the
disconnect is seen, whether the response is streamed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import anyio
import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from freetoken.config import ServerConfig
from freetoken.engine.protocol import LLM, CompletionChunk
from freetoken.server.admin_api import admin_routes
from freetoken.server.anthropic_api import anthropic_errors, count_tokens, prepare_messages
from freetoken.server.errors import ApiError, error_body, json_response
from freetoken.server.generation import PreparedRequest, aclose_quietly, api_error_from
from freetoken.server.openai_api import DEFAULT_MAX_TOKENS, prepare_chat, prepare_completion

log = logging.getLogger("freetoken.server")

HealthCheck = Callable[[], Mapping[str, Any] | Awaitable[Mapping[str, Any]]]
"""Returns a JSON-able mapping with a "status" key: "ok" → 200, anything else → 503."""

# A body over the size limit is read and thrown away (up to this much) before the 413 goes
# out, so that the client, still sending, sees the response rather than a reset connection.
_MAX_DRAIN_BYTES = 64 << 20

T = TypeVar("T")


def build_app(
    llm: LLM,
    config: ServerConfig,
    *,
    health: HealthCheck | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
) -> Starlette:
    """The ASGI app serving `llm` with the OpenAI API.

    health: called by GET /health; None means always healthy.
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
        if health is None:
            return json_response({"status": "ok"})
        try:
            info = health()
            if inspect.isawaitable(info):
                info = await info
            body = dict(info)
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
                f"The model `{model_id}` does not exist; this server serves `{llm.model_name}`.",
                param="model",
                code="model_not_found",
            )
        return json_response(model_card())

    async def chat_completions(request: Request) -> Response:
        return await _generate(request, llm, config, prepare_chat, default_max_tokens)

    async def completions(request: Request) -> Response:
        return await _generate(request, llm, config, prepare_completion, default_max_tokens)

    async def messages(request: Request) -> Response:
        return await anthropic_errors(_generate(request, llm, config, prepare_messages, default_max_tokens))

    async def messages_count_tokens(request: Request) -> Response:
        async def run() -> Response:
            body = await _read_body(request, config.max_request_bytes)
            return json_response(await count_tokens(body, llm))

        return await anthropic_errors(run())

    routes = [
        Route("/health", health_endpoint, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages_count_tokens, methods=["POST"]),
    ]
    routes += admin_routes(llm, config.admin_token, config.host)  # /v1/cache/status, /v1/cache/resize, /metrics
    return Starlette(
        routes=routes,
        exception_handlers={
            ApiError: _api_error_handler,
            HTTPException: _http_error_handler,
            Exception: _internal_error_handler,
        },
    )


async def _api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {request.url.path}"
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        err = ApiError(404, f"Unknown route: {where}.", code="not_found")
    elif exc.status_code == 405:
        allowed = headers.get("Allow", headers.get("allow", ""))
        err = ApiError(405, f"Method not allowed: {where} (allowed: {allowed}).", code="method_not_allowed")
    else:
        err = ApiError(exc.status_code, f"{exc.detail} ({where}).")
    err.headers = headers or None
    return err.response()


async def _internal_error_handler(request: Request, exc: Exception) -> Response:
    return ApiError(500, f"Internal server error ({type(exc).__name__}).", code="internal_error").response()


async def _read_body(request: Request, limit: int) -> bytes:
    too_large = ApiError(
        413, f"The request body exceeds the limit of {limit} bytes.", code="request_too_large"
    )
    length = request.headers.get("content-length", "")
    declared_too_large = length.isdigit() and int(length) > limit
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if declared_too_large or size > limit:
            if size > _MAX_DRAIN_BYTES:
                break
            continue
        parts.append(part)
    if declared_too_large or size > limit:
        raise too_large
    return b"".join(parts)


async def _generate(
    request: Request,
    llm: LLM,
    config: ServerConfig,
    prepare: Callable[[bytes, LLM, int], Awaitable[PreparedRequest]],
    default_max_tokens: int,
) -> Response:
    try:
        body = await _read_body(request, config.max_request_bytes)
    except ClientDisconnect:
        return Response(status_code=499)  # nobody is listening
    p = await prepare(body, llm, default_max_tokens)

    chunks: AsyncIterator[CompletionChunk] | None = None

    async def start() -> CompletionChunk:
        nonlocal chunks
        chunks = llm.generate(p.prompt_ids, p.params, p.request_id)
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
        return EventStreamResponse(p.events(first, chunks))
    try:
        disconnected, outcome = await _cancel_on_disconnect(request.receive, lambda: p.respond(first, chunks))
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


# ----------------------------------------------------------------------------- running


class _Uvicorn(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self._on_started()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # As uvicorn's, except that a caught SIGINT/SIGTERM is not raised again once the server
        # has stopped: `serve()` returns normally, so whoever started the engine stops it too.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class ApiServer:
    """One uvicorn server for one LLM; `serve()` runs until `shutdown()` or SIGINT/SIGTERM.

    `url` (e.g. "http://127.0.0.1:8000") is set and `ready` is set once it accepts connections;
    port 0 in the config binds a free port.
    """

    def __init__(
        self,
        llm: LLM,
        config: ServerConfig,
        *,
        health: HealthCheck | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        announce: bool = True,
        log_level: str = "warning",
        graceful_shutdown_s: float = 5.0,
    ) -> None:
        self.llm = llm
        self.config = config
        self.app = build_app(llm, config, health=health, default_max_tokens=default_max_tokens)
        self.url: str | None = None
        self.ready = threading.Event()
        self._announce = announce
        uv_config = uvicorn.Config(
            self._asgi,
            host=config.host,
            port=config.port,
            lifespan="on",
            interface="asgi3",
            access_log=False,
            log_level=log_level,
            timeout_graceful_shutdown=graceful_shutdown_s,
        )
        self._server = _Uvicorn(uv_config, self._started)

    async def serve(self) -> None:
        sock = bind_socket(self.config.host, self.config.port)
        host, port = sock.getsockname()[:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        try:
            await self._server.serve(sockets=[sock])
        finally:
            # Requests still running after the graceful-shutdown timeout are cancelled but not
            # awaited by uvicorn; let them close their engine streams before the engine goes.
            pending = [t for t in self._server.server_state.tasks if not t.done()]
            if pending:
                await asyncio.wait(pending, timeout=5.0)

    async def _asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        sent = {"start": False, "end": False}

        async def tracking_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent["start"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["end"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if not self._server.should_exit or scope["type"] != "http":
                raise
            # Cancelled by uvicorn's graceful-shutdown timeout: finish the response with an error
            # rather than cutting the connection.
            err = error_body("The server is shutting down.", type="server_error")
            if not sent["start"]:
                await json_response(err, status=503)(scope, receive, send)
            elif not sent["end"]:
                data = b"data: " + msgspec.json.encode(err) + b"\n\n"
                await send({"type": "http.response.body", "body": data, "more_body": False})

    def shutdown(self) -> None:
        """Ask the server to stop (safe from any thread); `serve()` returns once it has."""
        self._server.should_exit = True

    def _started(self) -> None:
        if self._announce:
            print(
                f"freetoken: serving {self.llm.model_name!r} at {self.url}/v1 (OpenAI API)",
                file=sys.stderr,
                flush=True,
            )
        self.ready.set()


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket bound to host:port (port 0: any free port)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.set_inheritable(True)
    return sock


async def serve(
    llm: LLM,
    config: ServerConfig,
    *,
    health: HealthCheck | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    log_level: str = "warning",
) -> None:
    """Serve `llm` until SIGINT/SIGTERM; prints the URL to stderr once listening."""
    server = ApiServer(llm, config, health=health, default_max_tokens=default_max_tokens, log_level=log_level)
    await server.serve()


def run(
    engine: AbstractAsyncContextManager[LLM] | Callable[[], AbstractAsyncContextManager[LLM]],
    config: ServerConfig,
    **kwargs: Any,
) -> None:
    """Start the engine, serve it until SIGINT/SIGTERM, then stop the engine (blocking)."""

    async def main() -> None:
        cm = engine if hasattr(engine, "__aenter__") else engine()  # type: ignore[operator]
        async with cm as llm:
            await serve(llm, config, **kwargs)

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
