"""Reading a request body: bounded in size, in time, and in JSON nesting.

- Size: a body over the limit is a 413. It is read and thrown away (up to `_MAX_DRAIN_BYTES`)
  before the answer goes out, so that a client still sending sees the answer rather than a
  reset connection.
- Time: a client that stops sending mid-body would hold its connection and its handler forever;
  the whole body must arrive within the timeout (408).
- Nesting: JSON decoders recurse per level, and a body nested a thousand deep (in any field,
  known or not) exhausts the stack. The depth is measured first by a scan that does not recurse:
  string literals are blanked out, then the running count of open brackets is a cumulative sum.
"""

from __future__ import annotations

import re

import anyio
import numpy as np
from starlette.requests import Request

from freetoken.server.errors import ApiError, bad_request

_MAX_DRAIN_BYTES = 64 << 20
# A JSON string literal (escapes included); what is inside one never counts as nesting.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[[ord("["), ord("{")]] = 1
_DEPTH_STEP[[ord("]"), ord("}")]] = -1


async def read_body(request: Request, *, limit: int, timeout_s: float) -> bytes:
    """The whole body of `request`: 413 above `limit` bytes, 408 if it takes longer than `timeout_s`."""
    length = request.headers.get("content-length", "")
    declared_too_large = length.isdigit() and int(length) > limit
    parts: list[bytes] = []
    size = 0
    try:
        with anyio.fail_after(timeout_s):
            async for part in request.stream():
                size += len(part)
                if declared_too_large or size > limit:
                    if size > _MAX_DRAIN_BYTES:
                        break
                    continue
                parts.append(part)
    except TimeoutError:
        raise ApiError(
            408,
            f"The request body did not arrive within {timeout_s:g} s.",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    if declared_too_large or size > limit:
        raise ApiError(413, f"The request body exceeds the limit of {limit} bytes.", code="request_too_large")
    return b"".join(parts)


def json_depth(body: bytes) -> int:
    """How deeply the arrays and objects of a JSON text nest (0 for a scalar); never recurses."""
    if b"[" not in body and b"{" not in body:
        return 0
    brackets = _STRING.sub(b'""', body)
    steps = _DEPTH_STEP[np.frombuffer(brackets, dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def check_depth(body: bytes, max_depth: int) -> None:
    """A 400 if the JSON in `body` nests deeper than `max_depth`."""
    depth = json_depth(body)
    if depth > max_depth:
        raise bad_request(
            f"The request body nests arrays and objects {depth} deep; at most {max_depth} levels are accepted.",
            code="too_deeply_nested",
        )


async def read_json_body(request: Request, *, limit: int, timeout_s: float, max_depth: int) -> bytes:
    """`read_body`, then `check_depth`: the raw JSON, safe to hand to a decoder."""
    body = await read_body(request, limit=limit, timeout_s=timeout_s)
    check_depth(body, max_depth)
    return body
