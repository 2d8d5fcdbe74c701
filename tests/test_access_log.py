"""One access-log line per request over a real socket (fake engine): text and JSON, streamed and not,
and `--log-format` reaching the server config."""

from __future__ import annotations

import json

import httpx

from freetoken.config import ServerConfig
from freetoken.server.access_log import access_line
from tests.fakes import FakeLLM
from tests.server_harness import running_server


def test_json_lines_carry_tokens_status_and_time(capfd):
    with running_server(FakeLLM(), config=ServerConfig(port=0, log_format="json")) as srv:
        client = srv.client()
        client.completions.create(model="fake-model", prompt="hi there", max_tokens=4)
        list(client.completions.create(model="fake-model", prompt="hi", max_tokens=3, stream=True))
        with httpx.Client(base_url=srv.url, timeout=10) as http:
            http.get("/v1/cache/status")
            http.get("/no/such/route")
    lines = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    done, streamed, status, missing = lines[-4:]
    assert done["method"] == "POST" and done["path"] == "/v1/completions" and done["status"] == 200
    assert done["prompt_tokens"] > 0 and done["completion_tokens"] > 0 and done["ms"] >= 0
    assert streamed["path"] == "/v1/completions" and streamed["completion_tokens"] > 0
    assert status == {**status, "path": "/v1/cache/status", "status": 200, "prompt_tokens": None}
    assert missing["status"] == 404 and missing["completion_tokens"] is None


def test_text_line_and_escaped_path():
    scope = {"method": "GET", "path": "/a\nb", "client": ("127.0.0.1", 5), "freetoken.usage": [3, 7]}
    assert access_line(scope, 200, 12.345, "text") == '127.0.0.1 "GET /a\\nb" 200 prompt=3 completion=7 12.3ms'
    assert access_line({"method": "GET", "path": "/", "client": None}, None, 1.0, "text") == '- "GET /" - 1.0ms'


def test_log_format_flag_reaches_the_server_config():
    from freetoken.__main__ import build_parser
    from freetoken.cli_args import server_config_from

    args = build_parser().parse_args(["serve", "--model", "m", "--log-format", "json"])
    assert server_config_from(args).log_format == "json"
    assert server_config_from(build_parser().parse_args(["serve", "--model", "m"])).log_format == "text"
