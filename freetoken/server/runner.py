"""Running the HTTP app (`app.build_app`) under uvicorn: bind, serve until SIGINT/SIGTERM or
`shutdown()`, finish requests cut by the graceful-shutdown timeout with an error.

Slow clients are bounded at each stage: a request's line and headers must arrive within
`header_timeout_s` of the connection opening or of the previous response (uvicorn's keep-alive
timer alone is cancelled by any byte, so one byte at a time would hold a connection forever);
its body within `body_timeout_s` (the app's 408, `body.read_body`); an idle keep-alive
connection closes after `keep_alive_s`.

    async with engine as llm:                       # anything that yields an LLM
        await serve(llm, ServerConfig(port=8000))   # until SIGINT / SIGTERM

or, synchronously, `run(engine, config)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import h11
import msgspec
import uvicorn
from starlette.types import Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from freetoken.config import ServerConfig
from freetoken.engine.protocol import LLM
from freetoken.server.access_log import AccessLog
from freetoken.server.admin_api import LOOPBACK_NAMES
from freetoken.server.app import build_app
from freetoken.server.errors import error_body, json_response
from freetoken.server.openai_api import DEFAULT_MAX_TOKENS
from freetoken.server.sse import json_data


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


class _HeadDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request head is not in within the deadline."""

    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's head arrived; its body has its own timeout
            self._disarm_head_deadline()

    def on_response_complete(self) -> None:
        self._arm_head_deadline()  # before the parent's, which may start a pipelined request
        super().on_response_complete()

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        self._head_deadline = self.loop.call_later(self._header_timeout_s, self._head_too_late)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_late(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        # A request h11 cannot parse (a header line too long, a malformed request line) gets the
        # OpenAI error shape rather than uvicorn's plain text: its path cannot be trusted to pick one.
        body = msgspec.json.encode(error_body(f"Invalid HTTP request: {msg}", code="invalid_http_request"))
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


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
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        announce: bool = True,
        log_level: str = "warning",
        graceful_shutdown_s: float = 5.0,
    ) -> None:
        self.llm = llm
        self.config = config
        self.app = AccessLog(build_app(llm, config, default_max_tokens=default_max_tokens), config.log_format)
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
            http=functools.partial(_HeadDeadlineH11, header_timeout_s=config.header_timeout_s),  # type: ignore[arg-type]
            ws="none",
            timeout_keep_alive=config.keep_alive_s,  # type: ignore[arg-type]
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
                data = b"data: " + json_data(err) + b"\n\n"
                await send({"type": "http.response.body", "body": data, "more_body": False})

    def shutdown(self) -> None:
        """Ask the server to stop (safe from any thread); `serve()` returns once it has."""
        self._server.should_exit = True

    def _started(self) -> None:
        if self._announce:
            print(
                f"freetoken: serving {self.llm.model_name!r} at {self.url}/v1 (OpenAI API: /v1/chat/completions; "
                f"Anthropic API: /v1/messages); dashboard at {self.url}/dashboard",
                file=sys.stderr,
                flush=True,
            )
            if self.config.api_key is None and self.config.host not in LOOPBACK_NAMES:
                print(
                    f"freetoken: warning: listening on {self.config.host} without --api-key: anyone who can "
                    "reach this address can use the APIs",
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
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    log_level: str = "warning",
) -> None:
    """Serve `llm` until SIGINT/SIGTERM; prints the URL to stderr once listening."""
    server = ApiServer(llm, config, default_max_tokens=default_max_tokens, log_level=log_level)
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
