"""The dashboard in a real browser (Debian's chromium, headless) over the real engine on a tiny model:
the page loads cleanly, its numbers move while a request streams, a resize from the page changes
/v1/cache/status, and a resize without the admin token shows the refusal."""

from __future__ import annotations

import threading

import httpx
import pytest

from freetoken.config import EngineConfig, MoeConfig, ServerConfig, TraceConfig
from freetoken.engine.llm import AsyncLLM
from tests.browser.chromium import chromium_context
from tests.server_harness import running_server

ADMIN_TOKEN = "dash-admin"


@pytest.fixture(scope="module")
def srv(make_checkpoint, tmp_path_factory):
    model_dir = make_checkpoint("qwen3_moe", "tiny", seed=8)
    trace = tmp_path_factory.mktemp("trace") / "trace.json"
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=256,
                          moe=MoeConfig(policy="hybrid", cache_slots=8, params={"ratio": 0.5}, cpu_threads=1),
                          served_model_name="tiny", trace=TraceConfig(timeline=str(trace)))
    server_config = ServerConfig(host="127.0.0.1", port=0, admin_token=ADMIN_TOKEN)
    # The first start of a session may compile the CPU expert kernels.
    with running_server(lambda: AsyncLLM.start(config), config=server_config, startup_timeout_s=300) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    with chromium_context(viewport={"width": 1300, "height": 1000}) as context:
        yield context


@pytest.fixture
def page(srv, browser):
    page = browser.new_page()
    problems: list[str] = []
    page.on("console", lambda msg: problems.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: problems.append(str(exc)))
    page.goto(f"{srv.url}/dashboard?interval=0.2")
    page.wait_for_function("() => document.getElementById('conn').textContent === 'live'", timeout=30_000)
    page.wait_for_function("() => document.getElementById('expert-slots').textContent !== '–'", timeout=30_000)
    page.problems = problems
    yield page
    page.close()


# Conditions are passed as functions: the page's Content-Security-Policy forbids evaluating strings.
def _text(page, element_id: str) -> str:
    return page.locator(f"#{element_id}").inner_text()


def test_page_loads_without_console_errors(page):
    page.wait_for_timeout(1500)  # a few snapshots drawn
    assert page.problems == []
    assert _text(page, "policy") == "hybrid"
    assert "r = 0.500" in _text(page, "split-ratio")
    assert _text(page, "bw-pcie_fill-profile").startswith("none")  # r is a parameter: no profile behind it
    assert "dense weights" in _text(page, "memory-legend")


def test_numbers_move_while_a_request_streams(srv, page):
    before = int(_text(page, "gen-tokens"))

    def stream() -> None:
        for _ in srv.client().completions.create(model="tiny", prompt="watch me", max_tokens=48, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}):
            pass

    worker = threading.Thread(target=stream)
    worker.start()
    try:
        page.wait_for_function(f"() => Number(document.getElementById('gen-tokens').textContent) > {before}",
                               timeout=60_000)
        page.wait_for_function("() => Number(document.getElementById('tok-rate').textContent) > 0", timeout=60_000)
        page.wait_for_function("() => document.getElementById('hit-rate').textContent.endsWith('%')", timeout=60_000)
        # the engine's own timings of its fills and CPU calls (cache/live_bandwidth.py)
        for link in ("pcie_fill", "cpu_expert"):
            page.wait_for_function(f"() => document.getElementById('bw-{link}-live').textContent.includes('GB/s')",
                                   timeout=60_000)
    finally:
        worker.join(120)
    # the tracer's spans reach the timeline
    page.wait_for_function("() => document.querySelectorAll('#timeline rect').length > 0", timeout=30_000)
    assert page.problems == []


def test_resize_from_the_page_changes_the_cache_status(srv, page):
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        slots = http.get("/v1/cache/status").json()["expert_slots"]
        page.fill("#resize-slots", str(slots + 2))
        page.fill("#admin-token", ADMIN_TOKEN)
        page.click("#resize-button")
        page.wait_for_function("() => document.getElementById('resize-result').className === 'ok'", timeout=30_000)
        assert http.get("/v1/cache/status").json()["expert_slots"] == slots + 2
    page.wait_for_function(f"() => document.getElementById('expert-slots').textContent === '{slots + 2}'",
                           timeout=30_000)


def test_a_resize_without_the_admin_token_shows_the_refusal(srv, page):
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        before = http.get("/v1/cache/status").json()
        page.fill("#resize-slots", str(before["expert_slots"] + 1))
        page.click("#resize-button")
        page.wait_for_function("() => document.getElementById('resize-result').className === 'refused'", timeout=30_000)
        assert http.get("/v1/cache/status").json()["expert_slots"] == before["expert_slots"]
    shown = _text(page, "resize-result")
    assert "Refused (401)" in shown and "admin token" in shown
