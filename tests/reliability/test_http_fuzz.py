"""A seeded fuzz of the real server on the tiny demo checkpoint: 500 requests across every
endpoint (tests/reliability/http_cases.py), none answered with a 5xx, every error in the shape of
its path's API, and a valid request still served afterwards."""

from __future__ import annotations

import collections

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from freetoken.config import EngineConfig
from freetoken.engine.llm import AsyncLLM
from tests.reliability.http_cases import Case, http_cases, problems
from tests.server_harness import running_server

FUZZ_REQUESTS = 500
MODEL = "demo"


@pytest.fixture(scope="module")
def srv(make_checkpoint):
    model_dir = make_checkpoint("qwen3_moe", "tiny")
    config = EngineConfig(model=str(model_dir), device="cpu", max_model_len=512, served_model_name=MODEL)
    with running_server(lambda: AsyncLLM.start(config)) as s:
        yield s


def test_fuzzed_requests_never_get_a_5xx_or_a_misshapen_error(srv):
    statuses: collections.Counter[int] = collections.Counter()
    with httpx.Client(base_url=srv.url, timeout=60) as http:

        @settings(max_examples=FUZZ_REQUESTS, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=http_cases(MODEL))
        def one(case: Case) -> None:
            response = case.send(http)
            statuses[response.status_code] += 1
            assert not problems(case, response), (case, problems(case, response))

        one()
        after = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0})
    assert sum(statuses.values()) >= FUZZ_REQUESTS
    assert statuses[200] > FUZZ_REQUESTS // 10 and sum(n for s, n in statuses.items() if s >= 400) > FUZZ_REQUESTS // 4
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] >= 1, after.text
