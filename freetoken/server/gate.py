"""What every request passes before it reaches a route: the API key, the content type, and CORS.

- API key (`ServerConfig.api_key`): every route but /health and the dashboard's page needs `Authorization: Bearer <key>`
  (OpenAI's clients) or `x-api-key: <key>` (Anthropic's); the admin token passes too. Compared
  in constant time. 401 otherwise.
- Content type: a POST must say `application/json` (parameters such as a charset allowed), 415
  otherwise. A web page can send a cross-site POST without asking first only as text/plain or a
  form; insisting on JSON makes the browser ask (a CORS preflight), which fails unless the page's
  origin is allowed, so no page can drive the server behind its user's back.
- CORS: no CORS headers at all unless origins are allowed (`--allow-origin`); then a request from
  an allowed origin gets `Access-Control-Allow-Origin`, and its preflight (OPTIONS) is answered
  here, before the API key is asked for, as browsers send preflights without credentials.

Errors are in the shape of the API the path belongs to (`errors.ApiError.response`).
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from freetoken.config import ServerConfig
from freetoken.server.dashboard import ASSET_PATHS
from freetoken.server.errors import ApiError

OPEN_PATHS = ("/health", *ASSET_PATHS)  # the dashboard's files hold no data
_ALLOWED_METHODS = b"GET, POST, OPTIONS"
_PREFLIGHT_MAX_AGE_S = b"600"


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def media_type(content_type: bytes) -> bytes:
    """`application/json` from `Application/JSON; charset=utf-8`."""
    return content_type.split(b";", 1)[0].strip().lower()


class Gate:
    """ASGI middleware in front of the app: API key, JSON-only POSTs, CORS (see the module doc)."""

    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        self.app = app
        self.allowed_origins = frozenset(origin.encode() for origin in config.allow_origins)
        self.credentials = tuple(s.encode() for s in (config.api_key, config.admin_token) if s is not None)
        self.key_required = config.api_key is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = _header(scope, b"origin")
        allowed_origin = origin if origin is not None and origin in self.allowed_origins else None
        if allowed_origin is not None:
            if scope["method"] == "OPTIONS" and _header(scope, b"access-control-request-method") is not None:
                await self._preflight(scope, allowed_origin, send)
                return
            send = _with_cors_headers(send, allowed_origin)
        error = self._refusal(scope)
        if error is not None:
            await error.response(scope["path"])(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> ApiError | None:
        if self.key_required and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            return ApiError(
                401,
                "A valid API key is required: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`.",
                code="invalid_api_key",  # OpenAI's own 401 is typed invalid_request_error, as here
                headers={"WWW-Authenticate": "Bearer"},
            )
        if scope["method"] == "POST":
            content_type = _header(scope, b"content-type")
            if content_type is None or media_type(content_type) != b"application/json":
                got = "none" if content_type is None else repr(content_type.decode("latin-1")[:100])
                return ApiError(
                    415,
                    f"POST bodies must be JSON, sent with `Content-Type: application/json` (got {got}).",
                    code="unsupported_media_type",
                )
        return None

    def _authorized(self, scope: Scope) -> bool:
        given: list[bytes] = []
        authorization = _header(scope, b"authorization")
        if authorization is not None:
            scheme, _, token = authorization.partition(b" ")
            if scheme.lower() == b"bearer":
                given.append(token.strip())
        if (api_key := _header(scope, b"x-api-key")) is not None:
            given.append(api_key.strip())
        # Every comparison runs, so the time taken says nothing about which one matched.
        matches = [hmac.compare_digest(g, c) for g in given for c in self.credentials]
        return any(matches)

    async def _preflight(self, scope: Scope, origin: bytes, send: Send) -> None:
        headers = [
            (b"access-control-allow-origin", origin),
            (b"access-control-allow-methods", _ALLOWED_METHODS),
            (b"access-control-max-age", _PREFLIGHT_MAX_AGE_S),
            (b"vary", b"Origin"),
            (b"content-length", b"0"),
        ]
        # The page's own headers (the clients add several of their own) are allowed as asked:
        # the origin is trusted, and the API key still guards every request that follows.
        if (asked := _header(scope, b"access-control-request-headers")) is not None:
            headers.append((b"access-control-allow-headers", asked))
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})


def _with_cors_headers(send: Send, origin: bytes) -> Send:
    async def send_with_cors(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [*message.get("headers", ()), (b"access-control-allow-origin", origin), (b"vary", b"Origin")]
            message = {**message, "headers": headers}
        await send(message)

    return send_with_cors
