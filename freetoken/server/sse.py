"""Server-sent events: each event's data is one JSON value on one line.

SSE ends a line only at CR or LF, but many clients split the stream with Unicode's line rules
(Python's `str.splitlines`, httpx's `aiter_lines`, some JavaScript parsers), which also break at
NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR. JSON allows those three raw inside strings, and
model output contains them; escaped, every event stays one line for every client and decodes to
the same value. (The other characters those rules break at are controls, which JSON escapes.)
"""

from __future__ import annotations

from typing import Any

import msgspec

# UTF-8 of U+0085, U+2028 and U+2029, and their JSON escapes
_LINE_BREAKERS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def json_data(value: Any) -> bytes:
    """The JSON of `value` for an event's `data:` line."""
    data = msgspec.json.encode(value)
    for raw, escaped in _LINE_BREAKERS:
        data = data.replace(raw, escaped)
    return data
