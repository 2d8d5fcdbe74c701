"""Run the HTTP server on a real socket in a background thread, for tests.

    with running_server(FakeLLM()) as srv:                 # an LLM ...
        srv.client().chat.completions.create(...)
    with running_server(lambda: start_engine(cfg)) as srv:  # ... or an engine to start
        ...

The engine argument is an LLM, an async context manager yielding one, or a zero-argument
callable returning such a context manager; a context manager is entered inside the server
thread's event loop, so the engine and the server share it, as in `freetoken serve`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

from freetoken.config import ServerConfig
from freetoken.server.openai_api import DEFAULT_MAX_TOKENS
from freetoken.server.runner import ApiServer

EngineLike = Any  # LLM | AbstractAsyncContextManager[LLM] | Callable[[], AbstractAsyncContextManager[LLM]]


@dataclass
class RunningServer:
    url: str  # http://127.0.0.1:PORT
    llm: Any
    config: ServerConfig

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (…/v1)."""
        return f"{self.url}/v1"

    def client(self, **kwargs: Any):
        """An official OpenAI client for this server (no retries, so errors surface at once)."""
        import openai

        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 60.0)
        return openai.OpenAI(base_url=self.base_url, api_key="unused", **kwargs)

    def anthropic_client(self, **kwargs: Any):
        """An official Anthropic client for this server (no retries either)."""
        import anthropic

        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 60.0)
        return anthropic.Anthropic(base_url=self.url, api_key="unused", **kwargs)


def _as_context(engine: EngineLike) -> AbstractAsyncContextManager[Any]:
    if hasattr(engine, "__aenter__"):
        return engine
    if hasattr(engine, "generate"):

        @asynccontextmanager
        async def given():
            yield engine

        return given()
    if callable(engine):
        return engine()
    raise TypeError(f"not an LLM or an engine context manager: {engine!r}")


@contextmanager
def running_server(
    engine: EngineLike,
    *,
    config: ServerConfig | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    graceful_shutdown_s: float = 5.0,
    startup_timeout_s: float = 120.0,
) -> Iterator[RunningServer]:
    """Serve `engine` on 127.0.0.1 (a free port unless `config` says otherwise) until the block ends."""
    config = config or ServerConfig(host="127.0.0.1", port=0)
    state: dict[str, Any] = {}

    async def main() -> None:
        async with _as_context(engine) as llm:
            server = ApiServer(
                llm,
                config,
                default_max_tokens=default_max_tokens,
                announce=False,
                graceful_shutdown_s=graceful_shutdown_s,
            )
            state["llm"] = llm
            state["server"] = server
            await server.serve()

    def thread_main() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # surfaced in the calling thread
            state["error"] = exc

    thread = threading.Thread(target=thread_main, name="freetoken-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not ((server := state.get("server")) and server.ready.wait(0.02)):
        if not thread.is_alive():
            raise RuntimeError("the server failed to start") from state.get("error")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not start within {startup_timeout_s} s")
    assert server.url is not None
    try:
        yield RunningServer(url=server.url, llm=state["llm"], config=config)
    finally:
        server.shutdown()
        thread.join(timeout=30)
        if "error" in state:
            raise RuntimeError("the server thread failed") from state["error"]
