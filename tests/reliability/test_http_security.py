"""The server's guards over a real socket: the API key, where the secrets come from, JSON-only
POSTs (no cross-site form posts), CORS only for allowed origins, header and body read timeouts,
and no redirect that echoes the Host header."""

from __future__ import annotations

import json
import socket

import anthropic
import httpx
import openai
import pytest

from freetoken.__main__ import main
from freetoken.config import ServerConfig
from freetoken.errors import FreetokenError
from tests.fakes import FakeLLM
from tests.server_harness import running_server

KEY, ADMIN = "k-123", "adm-456"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
MESSAGE = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


def assert_anthropic_error(r: httpx.Response, status: int, kind: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind and body["error"]["message"]


# ----------------------------------------------------------------------------- API key


@pytest.fixture(scope="module")
def keyed():
    with running_server(FakeLLM(), config=ServerConfig(port=0, api_key=KEY, admin_token=ADMIN)) as srv:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            srv.http = http
            yield srv


def test_health_needs_no_key(keyed):
    assert keyed.http.get("/health").status_code == 200


@pytest.mark.parametrize("path", ["/v1/models", "/v1/cache/status", "/metrics", "/v1/no-such-route"])
def test_every_other_route_needs_the_key(keyed, path):
    err = assert_openai_error(keyed.http.get(path), 401, "invalid_api_key")
    assert err["type"] == "invalid_request_error"  # as OpenAI's own 401s
    assert_openai_error(keyed.http.get(path, headers={"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(keyed.http.get(path, headers={"Authorization": f"Basic {KEY}"}), 401)
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}, {"Authorization": f"Bearer {ADMIN}"}):
        assert keyed.http.get(path, headers=headers).status_code != 401


def test_generation_routes_refuse_a_missing_key_in_their_shape(keyed):
    r = keyed.http.post("/v1/chat/completions", json=CHAT)
    assert_openai_error(r, 401, "invalid_api_key")
    assert_anthropic_error(keyed.http.post("/v1/messages", json=MESSAGE), 401, "authentication_error")


def test_the_official_clients_send_the_key(keyed):
    good = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY, max_retries=0)
    assert good.chat.completions.create(**CHAT).choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="nope", max_retries=0).models.list()
    claude = anthropic.Anthropic(base_url=keyed.url, api_key=KEY, max_retries=0)  # sends x-api-key
    assert claude.messages.create(**MESSAGE).content
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=keyed.url, api_key="nope", max_retries=0).messages.create(**MESSAGE)


def test_resize_needs_the_admin_token_not_the_key(keyed):
    as_user = keyed.http.post("/v1/cache/resize", json={"moe_slots": 8}, headers={"Authorization": f"Bearer {KEY}"})
    assert_openai_error(as_user, 401, "invalid_admin_token")
    as_admin = keyed.http.post("/v1/cache/resize", json={"moe_slots": 8}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert as_admin.status_code == 200 and as_admin.json()["expert_slots"] == 8


# ----------------------------------------------------------------------------- where secrets come from


def test_secret_from_flag_file_or_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("FREETOKEN_API_KEY", raising=False)
    assert ServerConfig.secret(None, None, "FREETOKEN_API_KEY", "api-key") is None
    monkeypatch.setenv("FREETOKEN_API_KEY", "from-env")
    assert ServerConfig.secret(None, None, "FREETOKEN_API_KEY", "api-key") == "from-env"
    assert ServerConfig.secret("from-flag", None, "FREETOKEN_API_KEY", "api-key") == "from-flag"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert ServerConfig.secret(None, str(key_file), "FREETOKEN_API_KEY", "api-key") == "from-file"
    with pytest.raises(FreetokenError, match="not both"):
        ServerConfig.secret("x", str(key_file), "FREETOKEN_API_KEY", "api-key")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(FreetokenError, match="empty"):
        ServerConfig.secret(None, str(tmp_path / "empty"), "FREETOKEN_API_KEY", "api-key")


@pytest.mark.parametrize("flag", ["--api-key-file", "--admin-token-file"])
def test_serve_with_an_unreadable_secret_file_is_a_one_line_error(tmp_path, capsys, flag):
    missing = tmp_path / "missing"
    assert main(["serve", flag, str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"freetoken: error: {flag} {missing}: cannot read it") and "\n" not in err


def test_ctl_takes_the_token_and_key_from_the_environment(keyed, monkeypatch, capsys):
    monkeypatch.delenv("FREETOKEN_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("FREETOKEN_API_KEY", raising=False)
    assert main(["ctl", "cache", "--url", keyed.url]) == 1
    assert "HTTP 401" in capsys.readouterr().err
    assert main(["ctl", "cache", "--url", keyed.url, "--api-key", KEY]) == 0
    assert main(["ctl", "cache", "--url", keyed.url, "--api-key", KEY, "--moe", "12"]) == 1  # not the admin token
    monkeypatch.setenv("FREETOKEN_ADMIN_TOKEN", ADMIN)
    assert main(["ctl", "cache", "--url", keyed.url, "--moe", "12"]) == 0
    assert keyed.llm.moe_slots == 12
    monkeypatch.delenv("FREETOKEN_ADMIN_TOKEN")
    monkeypatch.setenv("FREETOKEN_API_KEY", KEY)
    assert main(["ctl", "status", "--url", keyed.url]) == 0


# ----------------------------------------------------------------------------- content type, CORS


@pytest.fixture(scope="module")
def default():
    with running_server(FakeLLM()) as srv:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            srv.http = http
            yield srv


def test_a_cross_site_form_post_cannot_resize(default):
    before = default.http.get("/v1/cache/status").json()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = default.http.post("/v1/cache/resize", content=b'{"moe_slots": 4}', headers={"content-type": content_type})
        assert_openai_error(r, 415, "unsupported_media_type")
    assert_openai_error(default.http.post("/v1/cache/resize", content=b'{"moe_slots": 4}'), 415)  # none at all
    assert default.http.get("/v1/cache/status").json() == before
    r = default.http.post("/v1/messages", content=b"{}", headers={"content-type": "text/plain"})
    assert_anthropic_error(r, 415, "invalid_request_error")
    ok = default.http.post("/v1/cache/resize", content=b'{"moe_slots": 4}',
                           headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200 and ok.json()["expert_slots"] == 4


def test_a_resize_without_token_needs_a_loopback_host_name(default):
    rebound = default.http.post("/v1/cache/resize", json={"moe_slots": 4}, headers={"Host": "evil.example:8000"})
    assert_openai_error(rebound, 403, "admin_disabled")
    local = default.http.post("/v1/cache/resize", json={"moe_slots": 4}, headers={"Host": "localhost:8000"})
    assert local.status_code == 200


def _cors_headers(r: httpx.Response) -> set[str]:
    return {k for k in r.headers if k.lower().startswith("access-control-")}


def test_no_cors_headers_by_default(default):
    origin = {"Origin": "http://evil.example"}
    assert not _cors_headers(default.http.get("/v1/models", headers=origin))
    preflight = default.http.options("/v1/cache/resize", headers={
        **origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert preflight.status_code == 405 and not _cors_headers(preflight)


def test_cors_for_allowed_origins_only():
    allowed = "http://app.example:3000"
    config = ServerConfig(port=0, api_key=KEY, allow_origins=(allowed, "http://other.example"))
    with running_server(FakeLLM(), config=config) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        ask = {"Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, x-stainless-os"}
        # No key: browsers send preflights without credentials.
        preflight = http.options("/v1/chat/completions", headers={"Origin": allowed, **ask})
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == allowed
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert preflight.headers["access-control-allow-headers"] == "authorization, x-stainless-os"
        refused = http.options("/v1/chat/completions", headers={"Origin": "http://evil.example", **ask})
        assert refused.status_code != 204 and not _cors_headers(refused)
        r = http.post("/v1/chat/completions", json=CHAT, headers={"Origin": allowed, "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == allowed
        unauthorized = http.get("/v1/models", headers={"Origin": allowed})  # the page can read why it failed
        assert unauthorized.status_code == 401 and unauthorized.headers["access-control-allow-origin"] == allowed
        assert not _cors_headers(http.get("/v1/models", headers={"Origin": "http://evil.example", "x-api-key": KEY}))


# ----------------------------------------------------------------------------- timeouts, redirects


@pytest.fixture(scope="module")
def impatient():
    config = ServerConfig(port=0, header_timeout_s=0.5, body_timeout_s=0.5, keep_alive_s=60)
    with running_server(FakeLLM(), config=config) as srv:
        yield srv


def _connect(srv) -> socket.socket:
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)  # far beyond the server's 0.5 s
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):  # socket.timeout here means the server kept the connection
        data += chunk
    return data


def test_a_partial_request_head_is_cut_off(impatient):
    with _connect(impatient) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        assert _read_until_closed(sock) == b""


def test_a_head_sent_a_byte_at_a_time_after_a_response_is_cut_off(impatient):
    with _connect(impatient) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        sock.sendall(b"G")  # a byte of the next head; the keep-alive timer (60 s) alone would wait
        assert b"HTTP/1.1" not in _read_until_closed(sock)


def test_a_partial_body_gets_a_408_and_the_connection_closes(impatient):
    with _connect(impatient) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"messa")
        answer = _read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"code":"request_timeout"' in answer
    with httpx.Client(base_url=impatient.url, timeout=30) as http:  # still serving
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/models/"), ("GET", "/health/"),
                                              ("POST", "/v1/chat/completions/"), ("POST", "/v1/messages/")])
def test_no_redirect_echoes_the_host(default, method, path):
    r = default.http.request(method, path, json=CHAT, headers={"Host": "evil.example"})
    assert r.status_code == 404 and "location" not in r.headers, (r.status_code, r.headers)
    assert b"evil.example" not in r.content


@pytest.mark.parametrize("request_bytes", [
    b"NOT AN HTTP REQUEST\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (64 << 10),  # a head over h11's limit
])
def test_an_unparsable_request_gets_a_json_400(impatient, request_bytes):
    with _connect(impatient) as sock:
        sock.sendall(request_bytes)
        answer = _read_until_closed(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, answer[:300]
    assert json.loads(body)["error"]["code"] == "invalid_http_request"
