"""One access-log line per HTTP request: method, path, status, prompt and completion tokens, time.

    127.0.0.1 "POST /v1/chat/completions" 200 prompt=12 completion=40 812.4ms      (--log-format text)
    {"client": "127.0.0.1", "method": "POST", "path": "/v1/chat/completions", "status": 200,
     "prompt_tokens": 12, "completion_tokens": 40, "ms": 812.4}                     (--log-format json, one line)

The line is written when the response has ended, so a streamed response's time is the whole
stream's. The generation routes note their token counts into the request's ASGI scope as the
engine's chunks pass (`UsageNotes`); other routes log no counts (null / `-`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator
from typing import IO

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from freetoken.engine.protocol import CompletionChunk

USAGE_KEY = "freetoken.usage"  # scope key: [prompt_tokens, completion_tokens]
LOG_FORMATS = ("text", "json")


class UsageNotes:
    """The engine's chunks for one request, noting its token counts into `scope` as they pass."""

    def __init__(self, chunks: AsyncIterator[CompletionChunk], scope: Scope) -> None:
        self.chunks = chunks
        self.scope = scope

    def __aiter__(self) -> UsageNotes:
        return self

    async def __anext__(self) -> CompletionChunk:
        chunk = await anext(self.chunks)
        self.scope[USAGE_KEY] = [chunk.prompt_tokens, chunk.completion_tokens]
        return chunk

    async def aclose(self) -> None:
        await self.chunks.aclose()  # type: ignore[attr-defined]


def access_line(scope: Scope, status: int | None, ms: float, log_format: str) -> str:
    """The log line of one finished request (`status` None: no response was started)."""
    prompt, completion = scope.get(USAGE_KEY) or (None, None)
    client = scope.get("client")
    host = client[0] if client else "-"
    if log_format == "json":
        return msgspec.json.encode({
            "client": host, "method": scope["method"], "path": scope["path"], "status": status,
            "prompt_tokens": prompt, "completion_tokens": completion, "ms": round(ms, 1),
        }).decode()
    counts = "" if prompt is None else f" prompt={prompt} completion={completion}"
    path = scope["path"].encode("unicode_escape").decode("ascii")  # no control characters in the log
    return f'{host} "{scope["method"]} {path}" {status if status is not None else "-"}{counts} {ms:.1f}ms'


class AccessLog:
    """ASGI middleware writing `access_line` for every HTTP request to `stream`."""

    def __init__(self, app: ASGIApp, log_format: str, stream: IO[str] | None = None) -> None:
        if log_format not in LOG_FORMATS:
            raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
        self.app = app
        self.log_format = log_format
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status: list[int] = []

        async def noting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, noting_send)
        finally:
            line = access_line(scope, status[0] if status else None, (time.perf_counter() - started) * 1e3,
                               self.log_format)
            print(line, file=self.stream or sys.stderr, flush=True)
