"""The engine end to end on CPU: AsyncLLM -> Scheduler -> GpuRunner actors on a tiny checkpoint."""

from __future__ import annotations

import anyio
import pytest

from freetoken.config import EngineConfig, MoeConfig, SamplingParams
from freetoken.engine.llm import AsyncLLM
from freetoken.engine.model_runner import ModelRunner
from freetoken.errors import RequestError
from freetoken.loader.synth import write_synthetic_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("engine"), "qwen3_moe", "tiny", seed=5)


def _config(model_dir, rows=4, max_len=256):
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=max_len,
                        max_running_requests=rows)


async def _collect(llm, prompt, params, rid="r"):
    chunks = [c async for c in llm.generate(prompt, params, rid)]
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks


def _reference_greedy(model_dir, prompt, n):
    runner = ModelRunner(str(model_dir), _config(model_dir, rows=1), rows=1)
    out = [int(runner.prefill(runner.row_pages(0), prompt).argmax())]
    while len(out) < n:
        out.append(int(runner.decode([runner.row_pages(0)], [out[-1]], [len(prompt) + len(out) - 1]).argmax()))
    return out


PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [100, 200, 300, 400, 12, 13, 14], [42]]


def test_engine_greedy_matches_direct_runner(model_dir):
    async def main():
        async with AsyncLLM.start(_config(model_dir)) as llm:
            return await _collect(llm, PROMPTS[0], GREEDY)

    tokens, text, chunks = anyio.run(main)
    assert tokens == _reference_greedy(model_dir, PROMPTS[0], 12)
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 12
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_concurrent_requests_equal_sequential(model_dir):
    """Batched decode (and queueing: 4 requests, 2 rows) gives every request its solo tokens."""

    async def main(rows, concurrent):
        async with AsyncLLM.start(_config(model_dir, rows=rows)) as llm:
            results = {}

            async def one(i):
                results[i] = (await _collect(llm, PROMPTS[i], GREEDY, f"r{i}"))[0]

            if concurrent:
                async with anyio.create_task_group() as tg:
                    for i in range(len(PROMPTS)):
                        tg.start_soon(one, i)
            else:
                for i in range(len(PROMPTS)):
                    await one(i)
            return results

    assert anyio.run(main, 2, True) == anyio.run(main, 1, False)


def test_stop_string_stop_token_and_length(model_dir):
    async def main():
        async with AsyncLLM.start(_config(model_dir)) as llm:
            tokens, text, _ = await _collect(llm, PROMPTS[1], GREEDY)
            stop_tok = tokens[5]
            by_id = await _collect(llm, PROMPTS[1], SamplingParams(
                temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=(stop_tok,)))
            piece = text[len(text) // 2 : len(text) // 2 + 2]
            by_str = await _collect(llm, PROMPTS[1], SamplingParams(
                temperature=0.0, max_tokens=12, ignore_eos=True, stop=(piece,)))
            return tokens, text, stop_tok, by_id, by_str, piece

    tokens, text, stop_tok, by_id, by_str, piece = anyio.run(main)
    assert by_id[0] == tokens[: tokens.index(stop_tok) + 1] and by_id[2][-1].finish_reason == "stop"
    assert by_str[1] == text[: text.index(piece)] and by_str[2][-1].finish_reason == "stop"


def test_bad_requests_raise_before_streaming(model_dir):
    async def main():
        async with AsyncLLM.start(_config(model_dir, max_len=32)) as llm:
            for prompt, params in [
                (list(range(40)), GREEDY),  # longer than the context
                ([], GREEDY),
                ([10**9], GREEDY),  # outside the vocabulary
                ([1, 2], SamplingParams(top_p=2.0)),
            ]:
                with pytest.raises(RequestError):
                    await _collect(llm, prompt, params)
            # the engine still serves
            return (await _collect(llm, [1, 2], GREEDY))[2][-1].finish_reason

    assert anyio.run(main) == "length"


def test_client_going_away_frees_its_row(model_dir):
    """One row: the second request can only run if closing the first freed the row."""

    async def main():
        async with AsyncLLM.start(_config(model_dir, rows=1)) as llm:
            stream = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), "a")
            await stream.__anext__()
            await stream.__anext__()
            await stream.aclose()
            with anyio.fail_after(30):
                return await _collect(llm, PROMPTS[1], GREEDY, "b")

    assert anyio.run(main)[2][-1].finish_reason == "length"


def test_a_failing_step_fails_its_requests_and_the_engine_serves_on(model_dir):
    async def main():
        async with AsyncLLM.start(_config(model_dir)) as llm:
            real = llm.runner.decode

            def broken(*args):
                raise RuntimeError("device lost")

            llm.runner.decode = broken
            with anyio.fail_after(30):
                _, _, chunks = await _collect(llm, PROMPTS[0], GREEDY)
            llm.runner.decode = real
            _, _, after = await _collect(llm, PROMPTS[1], GREEDY)
            return chunks[-1], after[-1], llm.health(), llm.metrics()

    failed, after, health, metrics = anyio.run(main)
    assert failed.finish_reason == "error" and "device lost" in failed.error
    assert after.finish_reason == "length" and health["status"] == "ok"
    assert metrics["counters"]["requests_failed_total"] == 1


def test_an_actor_crash_fails_requests_instead_of_hanging(model_dir):
    """Supervision: when the runner actor itself dies, held requests get errors, health says so."""

    async def main():
        async with AsyncLLM.start(_config(model_dir)) as llm:
            llm.system.kill(llm.system.actors["gpu_runner"], RuntimeError("runner gone"))
            with anyio.fail_after(30):
                _, _, chunks = await _collect(llm, PROMPTS[0], GREEDY)
            return chunks[-1], llm.health()

    last, health = anyio.run(main)
    assert last.finish_reason == "error"
    assert health["status"] == "degraded" and health["actors"]["gpu_runner"].startswith("failed")


def test_hybrid_engine_runs_every_actor_and_reports_cache_status(model_dir):
    """The whole hierarchy behind the actors: hybrid split on a cache of 8 slots."""
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=128,
                          moe=MoeConfig(policy="hybrid", cache_slots=8, params={"ratio": 0.5}, cpu_threads=1))

    async def main():
        async with AsyncLLM.start(config) as llm:
            tokens = (await _collect(llm, PROMPTS[0], GREEDY))[0]
            return tokens, await llm.cache_status(), llm.health()

    tokens, status, health = anyio.run(main)
    assert tokens == _reference_greedy(model_dir, PROMPTS[0], 12)
    assert set(health["actors"]) == {"scheduler", "gpu_runner"}
    assert health["status"] == "ok" and health["ready"] and set(health["actors"].values()) == {"running"}
    assert health["device"] == "cpu" and health["moe_policy"] == "hybrid" and health["expert_slots"] == 8
    assert set(health["requests"]) == {"running", "waiting"} and health["requests"]["waiting"] == 0
    assert 0 < health["kv_pages_free"] <= health["kv_pages_available"] <= health["kv_pages"]
    assert status["policy"] == "hybrid" and status["expert_slots"] == 8
    assert status["hits"] > 0 and status["cpu_routes"] > 0
    assert status["cpu_poller"] == "team" and status["policy_params"]["fetch_recurring"] is True
    assert status["decode_graphs"] is None  # CUDA graphs only on CUDA (tests/gpu)
    assert status["dense_kernels"] == "reference" and not status["fused_decode_attention"]  # fused: CUDA only
