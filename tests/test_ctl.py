"""`freetoken ctl` against the fake server: status, cache, resize, errors, and no torch."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken.__main__ import main
from freetoken.ctl import base_url, parse_size
from tests.fakes import FakeLLM
from tests.server_harness import running_server

ROOT = Path(__file__).resolve().parents[1]
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


@pytest.fixture(scope="module")
def server():
    with running_server(FakeLLM()) as srv:
        yield srv


@pytest.fixture
def srv(server, monkeypatch):
    for var in _PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
    server.llm.moe_slots, server.llm.kv_tokens = FakeLLM.moe_slots, FakeLLM.kv_tokens
    return server


def _ctl(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["ctl", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there now


def test_parse_size():
    assert parse_size("4096") == 4096
    assert parse_size("32k") == 32 * 1024
    assert parse_size("32K") == 32768
    assert parse_size("1.5k") == 1536
    assert parse_size("2m") == 2 << 20
    assert parse_size(" 1_000 ") == 1000
    for bad in ("0", "-3", "0.1k", "1.5", "k", "", "32kb", "inf", "nan", "1e3"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_base_url():
    assert base_url("http://h:1") == "http://h:1"
    assert base_url("http://h:1/v1/") == "http://h:1"
    assert base_url("h:1") == "http://h:1"


def test_cache_status(srv, capsys):
    rc, out, err = _ctl(capsys, "cache", "--url", srv.url)
    assert rc == 0, err
    status = json.loads(out)
    assert status["expert_slots"] == 16 and status["kv_tokens"] == 8192


def test_cache_resize(srv, capsys):
    rc, out, err = _ctl(capsys, "cache", "--moe", "8", "--kv", "4k", "--url", srv.base_url + "/")
    assert rc == 0, err
    assert json.loads(out)["expert_slots"] == 8 and json.loads(out)["kv_tokens"] == 4096
    rc, out, err = _ctl(capsys, "cache", "--kv", "6144", "--url", srv.url)
    assert rc == 0 and json.loads(out)["kv_tokens"] == 6144 and json.loads(out)["expert_slots"] == 8
    assert (srv.llm.moe_slots, srv.llm.kv_tokens) == (8, 6144)


def test_cache_resize_rejected(srv, capsys):
    rc, out, err = _ctl(capsys, "cache", "--moe", "100", "--url", srv.url)
    assert rc == 1 and out == ""
    assert "HTTP 400" in err and "100 expert slots is more than the model's 64 experts" in err
    assert (srv.llm.moe_slots, srv.llm.kv_tokens) == (16, 8192)


def test_status(srv, capsys):
    rc, out, err = _ctl(capsys, "status", "--url", srv.url)
    assert rc == 0, err
    status = json.loads(out)
    assert status["health"]["status"] == "ok" and status["health"]["model"] == "fake-model"
    assert status["model"]["id"] == "fake-model"
    assert status["cache"]["expert_slots"] == 16
    assert status["server"] == srv.url


def test_status_unhealthy(srv, capsys):
    llm = FakeLLM()
    llm.health = lambda: {"status": "degraded", "actors": {"gpu": "crashed"}}
    with running_server(llm) as sick:
        rc, out, err = _ctl(capsys, "status", "--url", sick.url)
    assert rc == 1
    assert json.loads(out)["health"]["actors"] == {"gpu": "crashed"}


@pytest.mark.parametrize("command", [["status"], ["cache"], ["cache", "--kv", "32k"]])
def test_server_down(srv, capsys, command):
    url = _dead_url()
    rc, out, err = _ctl(capsys, *command, "--url", url)
    assert rc == 1 and out == ""
    assert f"cannot reach the server at {url}" in err


def test_bad_size_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["ctl", "cache", "--kv", "lots"])
    assert info.value.code == 2
    assert "'lots' is not a size" in capsys.readouterr().err


_PROBE = """
import json, sys
from freetoken.__main__ import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:
    rc = exc.code
heavy = [m for m in ("torch", "numpy", "triton", "freetoken.engine.llm", "starlette") if m in sys.modules]
sys.stderr.write("\\nHEAVY=" + json.dumps(heavy) + "\\n")
sys.exit(rc)
"""


def _probe(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _PROXY_VARS}
    return subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def _heavy(proc: subprocess.CompletedProcess) -> list[str]:
    line = next(x for x in proc.stderr.splitlines() if x.startswith("HEAVY="))
    return json.loads(line.removeprefix("HEAVY="))


def test_no_torch_import(srv):
    proc = _probe("ctl", "cache", "--moe", "32", "--url", srv.url)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["expert_slots"] == 32
    assert _heavy(proc) == []

    proc = _probe("ctl", "status", "--url", _dead_url())
    assert proc.returncode == 1
    assert "cannot reach the server" in proc.stderr
    assert _heavy(proc) == []

    proc = _probe("--help")
    assert proc.returncode == 0 and "ctl" in proc.stdout
    assert _heavy(proc) == []


def test_python_dash_m(srv):
    env = {k: v for k, v in os.environ.items() if k not in _PROXY_VARS}
    proc = subprocess.run(
        [sys.executable, "-m", "freetoken", "ctl", "cache", "--url", srv.url],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["kv_tokens"] == 8192
