"""The real engine behind a real socket: 16 concurrent streams from the official client while
the expert and KV caches are resized mid-stream over HTTP; every stream completes with the
tokens it would have had alone."""

from __future__ import annotations

import threading

import httpx
import pytest

from freetoken.config import EngineConfig, MoeConfig
from freetoken.engine.llm import AsyncLLM
from tests.server_harness import running_server


@pytest.fixture(scope="module")
def srv(make_checkpoint):
    model_dir = make_checkpoint("qwen3_moe", "tiny", seed=8)
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=256,
                          moe=MoeConfig(policy="hybrid", cache_slots=8, params={"ratio": 0.5}, cpu_threads=1),
                          served_model_name="tiny")
    with running_server(lambda: AsyncLLM.start(config)) as s:
        yield s


def _stream(client, prompt: str) -> tuple[str, str]:
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].choices[0].finish_reason


def test_sixteen_streams_survive_a_live_resize(srv):
    client = srv.client()
    prompts = [f"request number {i} says" for i in range(16)]
    alone = {p: _stream(client, p) for p in prompts[:3]}
    results: dict[str, tuple[str, str]] = {}
    errors: list[BaseException] = []
    started = threading.Barrier(17)

    def one(prompt: str) -> None:
        try:
            started.wait(30)
            results[prompt] = _stream(client, prompt)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    started.wait(30)
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        grown = http.post("/v1/cache/resize", json={"moe_slots": 12, "kv_tokens": 8192})
        refused = http.post("/v1/cache/resize", json={"moe_slots": 10**6})
        status = http.get("/v1/cache/status").json()
    for t in threads:
        t.join(120)
    assert grown.status_code == 200 and grown.json()["expert_slots"] == 12
    assert refused.status_code == 400 and "moe_slots" in refused.json()["error"]["message"]
    assert status["expert_slots"] == 12 and status["kv_tokens"] == 8192
    assert not errors and len(results) == 16
    assert all(reason == "length" for _, reason in results.values())
    for prompt, expected in alone.items():  # placement changes never change tokens
        assert results[prompt] == expected
