"""HTTP requests for fuzzing the server, and what every answer must look like.

`http_cases(model)` is a Hypothesis strategy of `Case`s across every endpoint: valid bodies
(small max_tokens, streaming or not), the same bodies mutated (a field dropped, retyped, set to
a huge or negative number, an unknown field with any JSON), any JSON value, raw bytes (invalid
UTF-8, truncated JSON), deeply nested arrays; wrong methods, wrong or missing content types,
stray credentials and origins, unknown and slash-suffixed paths. `problems(case, response)` lists
what is wrong with an answer: a 5xx, an error body not in the shape of the path's API, an
oversized error body, a stream that does not end as its API says. Shared by
tests/reliability/test_http_fuzz.py and benchmarks/fuzz.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import strategies as st

CHAT, COMPLETIONS, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"
COUNT = "/v1/messages/count_tokens"
RESIZE, STATUS, METRICS, HEALTH, MODELS = "/v1/cache/resize", "/v1/cache/status", "/metrics", "/health", "/v1/models"
POST_PATHS = (CHAT, COMPLETIONS, MESSAGES, COUNT, RESIZE)
GET_PATHS = (STATUS, METRICS, HEALTH, MODELS)
ODD_PATHS = ("/", "/v1", "/v1/nope", "/v1/messages/nope", "/v1/chat/completions/", "/v1/models/", "/health/",
             "/v1/cache", "/v2/chat/completions", "/v1/messages/count_tokens/x", "/%ff", "/v1/models/a/b")
MAX_ERROR_BODY_BYTES = 4096


@dataclass
class Case:
    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None

    def send(self, http: httpx.Client) -> httpx.Response:
        return http.request(self.method, self.path, content=self.body, headers=self.headers)

    def __repr__(self) -> str:  # Hypothesis prints failing cases; keep huge bodies readable
        body = self.body if self.body is None or len(self.body) <= 300 else self.body[:300] + b"..."
        return f"Case({self.method} {self.path} headers={self.headers} body={body!r})"


# ----------------------------------------------------------------------------- bodies

_json_scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20)
)
json_values = st.recursive(
    _json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_odd_numbers = st.sampled_from([0, -1, -(2**63), 2**63, 2**64, 10**30, 1.5, 1e308, -1e308])
_text = st.text(min_size=1, max_size=16)


def _user_messages(draw: st.DrawFn) -> list[dict[str, Any]]:
    return [{"role": "user", "content": draw(_text)}]


@st.composite
def valid_body(draw: st.DrawFn, path: str, model: str) -> dict[str, Any]:
    """A body the server should accept at `path` (small outputs, so the fuzz stays quick)."""
    max_tokens = draw(st.integers(1, 4))
    stream = draw(st.booleans())
    if path == CHAT:
        return {"model": model, "messages": _user_messages(draw), "max_tokens": max_tokens, "temperature": 0,
                "stream": stream}
    if path == COMPLETIONS:
        return {"model": model, "prompt": draw(_text), "max_tokens": max_tokens, "stream": stream}
    if path == MESSAGES:
        return {"model": model, "messages": _user_messages(draw), "max_tokens": max_tokens, "stream": stream}
    if path == COUNT:
        return {"model": model, "messages": _user_messages(draw)}
    if path == RESIZE:  # small sizes the demo engine can take, or refuse
        key = draw(st.sampled_from(["moe_slots", "kv_tokens"]))
        return {key: draw(st.integers(1, 48 if key == "moe_slots" else 8192))}
    return {}


@st.composite
def mutated(draw: st.DrawFn, body: dict[str, Any]) -> dict[str, Any]:
    """`body` with one change: a field dropped, replaced by any JSON or an odd number, or an unknown one added."""
    body = dict(body)
    keys = sorted(body)
    how = draw(st.sampled_from(["drop", "retype", "number", "unknown", "deep_unknown"] if keys else ["unknown"]))
    if how == "drop":
        body.pop(draw(st.sampled_from(keys)))
    elif how == "retype":
        body[draw(st.sampled_from(keys))] = draw(json_values)
    elif how == "number":
        body[draw(st.sampled_from(keys))] = draw(_odd_numbers)
    elif how == "unknown":
        body[draw(st.text(min_size=1, max_size=8))] = draw(json_values)
    else:
        depth = draw(st.integers(20, 1500))
        body["metadata_x"] = json.loads("[" * depth + "]" * depth)
    return body


def _nested(depth: int, opener: str) -> bytes:
    closer = {"[": "]", '{"a":': "}"}[opener]
    inner = "1" if opener != "[" else ""
    return (opener * depth + inner + closer * depth).encode()


@st.composite
def body_bytes(draw: st.DrawFn, path: str, model: str) -> bytes:
    kind = draw(st.sampled_from(["valid", "valid", "valid", "mutated", "mutated", "mutated", "json", "bytes",
                                 "truncated", "nested", "bad_utf8"]))
    if kind in ("valid", "mutated", "truncated", "bad_utf8"):
        body = draw(valid_body(path, model))
        if kind == "mutated":
            body = draw(mutated(body))
        raw = json.dumps(body).encode()
        if kind == "truncated":
            return raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
        if kind == "bad_utf8":
            return raw.replace(b'"model"', b'"mo\xff\xfedel"', 1) if b'"model"' in raw else b'{"\xc3\x28": 1}'
        return raw
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    if kind == "nested":
        return _nested(draw(st.integers(30, 3000)), draw(st.sampled_from(["[", '{"a":'])))
    return draw(st.binary(max_size=64))


# ----------------------------------------------------------------------------- requests

_CONTENT_TYPES = ["application/json"] * 10 + ["application/json; charset=utf-8", "text/plain",
                                               "application/x-www-form-urlencoded", "", "application/jsonx", None]
_STRAY_HEADERS = st.sampled_from([{}, {}, {"Authorization": "Bearer nope"}, {"x-api-key": "nope"},
                                  {"Origin": "http://evil.example"}, {"Authorization": "Basic Zm9vOmJhcg=="},
                                  {"Accept": "text/event-stream"}, {"Host": "evil.example"}])


@st.composite
def http_cases(draw: st.DrawFn, model: str) -> Case:
    """A request to the server serving `model` (see the module doc)."""
    where = draw(st.sampled_from(["post", "post", "post", "post", "get", "odd"]))
    path = draw(st.sampled_from({"post": POST_PATHS, "get": GET_PATHS, "odd": ODD_PATHS}[where]))
    if where == "get" and path == MODELS and draw(st.booleans()):
        path = f"{MODELS}/{draw(st.sampled_from([model, 'other', 'x' * 5000]))}"
    default_method = "POST" if path in POST_PATHS else "GET"
    method = draw(st.sampled_from([default_method] * 20 + ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]))
    headers = dict(draw(_STRAY_HEADERS))
    body = None
    if method in ("POST", "PUT", "PATCH") or draw(st.integers(0, 9)) == 0:
        body = draw(body_bytes(path if path in POST_PATHS else CHAT, model))
        content_type = draw(st.sampled_from(_CONTENT_TYPES))
        if content_type is not None:
            headers["Content-Type"] = content_type
    return Case(method, path, headers, body)


# ----------------------------------------------------------------------------- answers


def _error_shape_problems(path: str, body: Any) -> list[str]:
    if path.startswith(MESSAGES):
        ok = (isinstance(body, dict) and body.get("type") == "error" and isinstance(body.get("error"), dict)
              and set(body["error"]) == {"type", "message"} and isinstance(body["error"]["message"], str)
              and body["error"]["message"] and isinstance(body["error"]["type"], str))
        return [] if ok else [f"not an Anthropic error body: {str(body)[:200]}"]
    ok = (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict)
          and set(body["error"]) == {"message", "type", "param", "code"}
          and isinstance(body["error"]["message"], str) and body["error"]["message"])
    return [] if ok else [f"not an OpenAI error body: {str(body)[:200]}"]


def _stream_problems(path: str, text: str) -> list[str]:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    if path.startswith(MESSAGES):
        kinds = [json.loads(e).get("type") for e in events]
        return [] if kinds and kinds[-1] == "message_stop" and "error" not in kinds else [f"stream ends {kinds[-3:]}"]
    if not events or events[-1] != "[DONE]":
        return [f"stream does not end with [DONE]: {events[-2:]}"]
    bad = [e for e in events[:-1] if "error" in json.loads(e)]
    return [f"error event in the stream: {bad[0][:200]}"] if bad else []


def problems(case: Case, response: httpx.Response) -> list[str]:
    """What is wrong with `response` as the answer to `case` (empty when nothing is)."""
    status = response.status_code
    if status >= 500:
        return [f"HTTP {status}: {response.text[:300]}"]
    if case.method == "HEAD" or status in (204, 304) or status < 300 and case.path in (METRICS,):
        return []
    if 300 <= status < 400:
        return [f"HTTP {status} redirect to {response.headers.get('location')!r}"]
    content_type = response.headers.get("content-type", "")
    if status >= 400:
        if len(response.content) > MAX_ERROR_BODY_BYTES:
            return [f"an error body of {len(response.content)} bytes"]
        if not content_type.startswith("application/json"):
            return [f"an error as {content_type!r}"]
        return _error_shape_problems(case.path, response.json())
    if content_type.startswith("text/event-stream"):
        return _stream_problems(case.path, response.text)
    if not content_type.startswith("application/json"):
        return [f"HTTP {status} as {content_type!r}"]
    response.json()
    return []
