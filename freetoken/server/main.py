"""`python -m freetoken serve`: the engine behind the HTTP APIs, in one process."""

from __future__ import annotations

import asyncio

from freetoken.config import EngineConfig, ServerConfig
from freetoken.engine.llm import AsyncLLM
from freetoken.server.runner import serve


def run_server(engine: EngineConfig, server: ServerConfig) -> int:
    async def main() -> None:
        async with AsyncLLM.start(engine) as llm:
            await serve(llm, server)

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    return 0
