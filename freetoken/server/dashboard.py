"""The live dashboard: a static page shipped in the package, fed by one snapshot and one SSE stream.

    GET /dashboard                 the page (HTML; its script and style under /dashboard/...)
    GET /v1/dashboard/snapshot     one snapshot as JSON (below)
    GET /v1/dashboard/events       the same snapshot as an SSE event every `interval` seconds (0.1-10, default 1)

A snapshot is the engine's raw state; the page computes rates from the difference of two:

    {"time": unix seconds, "metrics": LLM.metrics(), "cache": LLM.cache_status(),
     "health": LLM.health(), "spans": LLM.recent_spans(SPANS)}

The page and its assets hold no data, so they are served without the API key (a browser cannot
attach one to a page load); the page's own requests send the key the user types into it, and its
resize control posts to `POST /v1/cache/resize`, so it passes the same admin check as any client.
The Content-Security-Policy keeps the page to its own origin: it loads nothing from elsewhere.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator
from importlib import resources

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from freetoken.engine.protocol import LLM
from freetoken.server.errors import bad_request, json_response
from freetoken.server.generation import api_error_from
from freetoken.server.sse import json_data

PAGE_PATH = "/dashboard"
# name -> media type of every file the page is made of
ASSETS = {"index.html": "text/html; charset=utf-8", "dashboard.js": "text/javascript; charset=utf-8",
          "dashboard.css": "text/css; charset=utf-8"}
ASSET_PATHS = (PAGE_PATH, *(f"{PAGE_PATH}/{name}" for name in ASSETS))
SPANS = 400  # enough for the last few decode steps of a model's layers
_CSP = "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"
ASSET_HEADERS = {"Content-Security-Policy": _CSP, "Cache-Control": "no-cache"}  # every page file's
_INTERVAL_S = (0.1, 1.0, 10.0)  # least, default, most


def asset(name: str) -> bytes:
    """One of the page's files (ASSETS), as the package ships it."""
    return resources.files("freetoken.server").joinpath("dashboard_page", name).read_bytes()


async def snapshot(llm: LLM) -> dict:
    """The engine's state for the dashboard (see the module doc)."""
    metrics = llm.metrics()
    if inspect.isawaitable(metrics):
        metrics = await metrics
    return {"time": time.time(), "metrics": metrics, "cache": await llm.cache_status(), "health": llm.health(),
            "spans": llm.recent_spans(SPANS)}


def _interval(request: Request) -> float:
    raw = request.query_params.get("interval")
    least, default, most = _INTERVAL_S
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not least <= value <= most:
        raise bad_request(f"`interval` must be a number of seconds from {least} to {most}.", param="interval")
    return value


def dashboard_routes(llm: LLM) -> list[Route]:
    """The dashboard's routes for `llm`, to add to the app's routes."""

    def page_file(name: str):
        async def serve(request: Request) -> Response:
            return Response(asset(name), media_type=ASSETS[name], headers=ASSET_HEADERS)

        return serve

    async def snapshot_endpoint(request: Request) -> Response:
        try:
            return json_response(await snapshot(llm))
        except Exception as exc:
            raise api_error_from(exc) from exc

    async def events_endpoint(request: Request) -> Response:
        interval = _interval(request)

        async def events() -> AsyncIterator[bytes]:
            while True:
                yield b"data: " + json_data(await snapshot(llm)) + b"\n\n"
                await anyio.sleep(interval)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    routes = [Route(PAGE_PATH, page_file("index.html"), methods=["GET"])]
    routes += [Route(f"{PAGE_PATH}/{name}", page_file(name), methods=["GET"]) for name in ASSETS]
    routes += [Route("/v1/dashboard/snapshot", snapshot_endpoint, methods=["GET"]),
               Route("/v1/dashboard/events", events_endpoint, methods=["GET"])]
    return routes
