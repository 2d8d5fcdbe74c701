"""Operator routes: the cache split and Prometheus metrics.

    GET  /v1/cache/status   the memory split (policy, expert slots, KV tokens, hit rate, ...)
    POST /v1/cache/resize   {"moe_slots": int | null, "kv_tokens": int | null} → 200 with the new status;
                            400 for a bad body or a size the engine refuses (its caches stay as they were)
    GET  /metrics           Prometheus text exposition format, version 0.0.4 (server/prometheus.py)
"""

from __future__ import annotations

import hmac
import inspect
import logging

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from freetoken.config import ServerConfig
from freetoken.engine.protocol import LLM
from freetoken.server.body import read_json_body
from freetoken.server.errors import ApiError, bad_request, cut, json_response, shown
from freetoken.server.generation import api_error_from
from freetoken.server.prometheus import CONTENT_TYPE, render_prometheus

log = logging.getLogger("freetoken.server")

RESIZE_FIELDS = ("moe_slots", "kv_tokens")
_MAX_BODY_BYTES = 64 << 10

LOOPBACK_NAMES = ("127.0.0.1", "::1", "localhost")


def _host_name(host_header: str) -> str:
    """The name in a Host header: `[::1]:8000` → `::1`, `localhost:8000` → `localhost`."""
    if host_header.startswith("["):
        return host_header[1:].partition("]")[0]
    return host_header.rpartition(":")[0] if host_header.count(":") == 1 else host_header


def _check_admin(request: Request, token: str | None, host: str) -> None:
    """Resizing is an operator's act: a bearer token when one is configured, else loopback only.

    Without a token, a request must also name a loopback host: a web page whose own name was
    re-pointed at 127.0.0.1 (DNS rebinding) talks to the server as its own origin, but its
    requests still carry its own name in Host."""
    if token is not None:
        given = request.headers.get("authorization", "").encode("latin-1")
        if not hmac.compare_digest(given, b"Bearer " + token.encode()):
            raise ApiError(401, "Resizing the caches needs the admin token (Authorization: Bearer ...).",
                           code="invalid_admin_token", type="authentication_error")
    elif host not in LOOPBACK_NAMES:
        raise ApiError(403, "Resizing the caches is disabled on a non-loopback address unless the server "
                       "was started with --admin-token.", code="admin_disabled", type="permission_error")
    elif _host_name(request.headers.get("host", "")) not in LOOPBACK_NAMES:
        raise ApiError(403, "Resizing the caches without --admin-token needs a request to a loopback name "
                       f"(127.0.0.1, localhost, [::1]), not {shown(request.headers.get('host', ''))}.",
                       code="admin_disabled", type="permission_error")


def admin_routes(llm: LLM, config: ServerConfig) -> list[Route]:
    """The operator routes for `llm`, to add to the app's routes."""

    async def cache_status(request: Request) -> Response:
        try:
            status = await llm.cache_status()
        except Exception as exc:
            raise api_error_from(exc) from exc
        return json_response(status)

    async def cache_resize(request: Request) -> Response:
        _check_admin(request, config.admin_token, config.host)
        try:
            body = await read_json_body(
                request, limit=_MAX_BODY_BYTES, timeout_s=config.body_timeout_s, max_depth=config.max_json_depth
            )
        except ClientDisconnect:
            return Response(status_code=499)
        sizes = parse_resize_body(body)
        try:
            status = await llm.resize_cache(sizes["moe_slots"], sizes["kv_tokens"])
        except Exception as exc:
            raise api_error_from(exc) from exc
        return json_response(status)

    async def metrics(request: Request) -> Response:
        data = llm.metrics()
        if inspect.isawaitable(data):
            data = await data
        return Response(render_prometheus(data), media_type=CONTENT_TYPE)

    return [
        Route("/v1/cache/status", cache_status, methods=["GET"]),
        Route("/v1/cache/resize", cache_resize, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


def parse_resize_body(body: bytes) -> dict[str, int | None]:
    """{"moe_slots": int | None, "kv_tokens": int | None} from a resize request body, or ApiError 400."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request('The request body must be a JSON object like {"moe_slots": 64, "kv_tokens": 32768}.')
    for key in data:
        if key not in RESIZE_FIELDS:
            raise bad_request(
                f"Unknown field `{cut(key)}`; a resize takes `moe_slots` and/or `kv_tokens`.",
                param=cut(key),
                code="unknown_parameter",
            )
    sizes: dict[str, int | None] = {}
    for key in RESIZE_FIELDS:
        value = data.get(key)
        if value is not None and (type(value) is not int or value <= 0):
            raise bad_request(
                f"`{key}` must be a positive integer or null, not {cut(msgspec.json.encode(value).decode())}.",
                param=key,
            )
        sizes[key] = value
    if all(v is None for v in sizes.values()):
        raise bad_request("Give `moe_slots` and/or `kv_tokens` (positive integers) to resize.", param="moe_slots")
    return sizes
