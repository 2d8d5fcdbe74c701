"""Error bodies in each API's own shape.

OpenAI's: `{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`; Anthropic's:
`{"type": "error", "error": {"type": ..., "message": ...}}`. The official clients turn both into
their typed exceptions (400 → BadRequestError, 401 → AuthenticationError, ...). Every error under
`/v1/messages` (the Anthropic API) is answered in Anthropic's shape, every other one in OpenAI's
(`error_response`).

An error message may quote what the client sent; `shown` bounds each quoted value, and no
message grows past `MAX_MESSAGE_CHARS`, so a huge field never comes back as a huge error body.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import Response

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
ANTHROPIC_PREFIX = "/v1/messages"
SHOWN_CHARS = 100
MAX_MESSAGE_CHARS = 1000

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def cut(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` for an error message, cut to `limit` characters with an ellipsis."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """`repr(value)` for an error message, cut to `limit` characters with an ellipsis."""
    return cut(repr(value), limit)


class ApiError(Exception):
    """An error to send back as an HTTP response, in the shape of the API it answers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = cut(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = None if param is None else cut(param, MAX_MESSAGE_CHARS)
        self.code = code
        self.type = type or (SERVER_ERROR if status >= 500 else INVALID_REQUEST)
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def anthropic_body(self) -> dict[str, Any]:
        kind = _ANTHROPIC_TYPES.get(self.status, INVALID_REQUEST if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str = "") -> Response:
        """The response for a request to `path`: Anthropic-shaped under /v1/messages, else OpenAI-shaped."""
        body = self.anthropic_body() if is_anthropic_path(path) else self.body()
        return json_response(body, status=self.status, headers=self.headers)


def is_anthropic_path(path: str) -> bool:
    return path.startswith(ANTHROPIC_PREFIX)


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="unsupported_parameter")


def error_body(
    message: str, *, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def json_response(content: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        msgspec.json.encode(content), status_code=status, headers=headers, media_type="application/json"
    )
