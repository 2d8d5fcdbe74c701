"""OpenAI-style error bodies.

Every error the HTTP layer returns has the shape
`{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`, which the official
clients turn into their typed exceptions (400 → BadRequestError, 404 → NotFoundError, ...).
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import Response

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class ApiError(Exception):
    """An error to send back as an HTTP response with an OpenAI-style body."""

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
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or (SERVER_ERROR if status >= 500 else INVALID_REQUEST)
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> Response:
        return json_response(self.body(), status=self.status, headers=self.headers)


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
