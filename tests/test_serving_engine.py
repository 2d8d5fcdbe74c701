"""Serving features of the engine on CPU: chunked prefill, prefix reuse across turns, logprobs,
live cache resize between steps, metrics, many concurrent streams."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from freetoken.config import EngineConfig, MoeConfig, SamplingParams, SchedulerConfig
from freetoken.engine.llm import AsyncLLM
from freetoken.errors import RequestError
from freetoken.moe.policy import params_for

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPT = [5, 9, 14, 200, 31, 7, 88, 123, 42, 17, 3, 250, 61, 19, 77, 8]
PAGE = EngineConfig().kv.page_size


@pytest.fixture(scope="module")
def model_dir(make_checkpoint):
    return make_checkpoint("qwen3_moe", "tiny", seed=6)


def _config(model_dir, moe=None, **kw):
    """The test's engine: one CPU expert worker, whatever `moe` asks."""
    moe = msgspec.structs.replace(moe or MoeConfig(), cpu_threads=1)
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=256, moe=moe, **kw)


async def _run(llm, prompt, params=GREEDY, rid="r"):
    chunks = [c async for c in llm.generate(prompt, params, rid)]
    return [t for c in chunks for t in c.token_ids], chunks


def _solo(model_dir, prompt, **kw):
    async def main():
        async with AsyncLLM.start(_config(model_dir, **kw)) as llm:
            return (await _run(llm, prompt))[0]

    return anyio.run(main)


def test_chunked_prefill_gives_the_same_tokens(model_dir):
    assert _solo(model_dir, PROMPT, scheduler=SchedulerConfig(prefill_chunk=3)) == _solo(model_dir, PROMPT)


def test_next_turn_reuses_the_previous_turns_kv(model_dir):
    """Turn 2 extends turn 1's prompt and output: only the new suffix is prefilled, and the
    tokens equal those of a fresh engine prefilling everything."""

    async def main():
        async with AsyncLLM.start(_config(model_dir, max_running_requests=2)) as llm:
            first, _ = await _run(llm, PROMPT, rid="t1")
            turn2 = PROMPT + first + [11, 12, 13]
            second, chunks = await _run(llm, turn2, rid="t2")
            return turn2, second, chunks[-1].cached_tokens, llm.metrics()

    turn2, second, cached, metrics = anyio.run(main)
    in_kv = len(PROMPT) + 10 - 1  # the prompt and the 9 outputs fed back
    assert cached == in_kv // PAGE * PAGE  # every full page of it
    assert metrics["counters"]["cached_prompt_tokens_total"] == cached
    assert second == _solo(model_dir, turn2)


def test_logprobs_come_with_each_token(model_dir):
    async def main():
        async with AsyncLLM.start(_config(model_dir)) as llm:
            return await _run(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True))

    tokens, chunks = anyio.run(main)
    for chunk in chunks:
        (lp,) = chunk.logprobs
        assert lp.token_id == chunk.token_ids[0] and lp.logprob <= 0
        assert len(lp.top) == 2 and lp.top[0][0] == lp.token_id  # greedy: the best is the one taken


def test_resize_during_streaming_keeps_tokens_and_rejects_impossible_sizes(model_dir):
    kw = dict(moe=MoeConfig(policy="hybrid", cache_slots=8, params={"ratio": 0.5}))

    async def main():
        async with AsyncLLM.start(_config(model_dir, **kw)) as llm:
            before = await llm.cache_status()
            with pytest.raises(RequestError):
                await llm.resize_cache(moe_slots=10**6, kv_tokens=None)
            with pytest.raises(RequestError):
                await llm.resize_cache(moe_slots=None, kv_tokens=2)  # below one full-length sequence
            with pytest.raises(RequestError, match="free"):
                await llm.resize_cache(moe_slots=None, kv_tokens=2**44)  # more than the machine has
            assert await llm.cache_status() == before  # rejected: nothing changed
            params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
            tokens = []
            stream = llm.generate(PROMPT, params, "s")
            async for chunk in stream:
                tokens += chunk.token_ids
                if len(tokens) == 5:
                    grown = await llm.resize_cache(moe_slots=12, kv_tokens=5 * 256)
                if len(tokens) == 12:
                    shrunk = await llm.resize_cache(moe_slots=4, kv_tokens=None)
            return tokens, grown, shrunk, llm.max_model_len

    tokens, grown, shrunk, max_len = anyio.run(main)
    assert grown["expert_slots"] == 12 and grown["kv_tokens"] == 5 * 256 and max_len == 256
    assert shrunk["expert_slots"] == 4 and shrunk["hits"] > 0
    assert len(tokens) == 24

    async def reference():
        async with AsyncLLM.start(_config(model_dir, **kw)) as llm:
            return (await _run(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)))[0]

    assert tokens == anyio.run(reference)


def test_sixteen_concurrent_streams_all_finish_with_their_own_tokens(model_dir):
    prompts = [[(7 * i + j) % 900 + 1 for j in range(3 + i % 5)] for i in range(16)]

    async def main():
        async with AsyncLLM.start(_config(model_dir, max_running_requests=4)) as llm:
            out = {}

            async def one(i):
                out[i] = (await _run(llm, prompts[i], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                     f"c{i}"))[0]

            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    for i in range(16):
                        tg.start_soon(one, i)
            return out, llm.metrics()

    out, metrics = anyio.run(main)
    assert all(len(out[i]) == 6 for i in range(16))
    assert out[3] == _solo(model_dir, prompts[3])[:6]
    assert metrics["counters"]["requests_finished_total"] == 16
    assert metrics["histograms"]["time_to_first_token_seconds"]["count"] == 16


def test_text_held_for_a_stop_string_is_released_when_a_stop_token_ends(model_dir):
    """With a stop string that never matches, ending on a stop token must not lose the tail."""

    async def main():
        async with AsyncLLM.start(_config(model_dir)) as llm:
            free, _ = await _run(llm, PROMPT)
            stop_tok = free[4]
            params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop=("\x00never\x00",),
                                    stop_token_ids=(stop_tok,))
            tokens, chunks = await _run(llm, PROMPT, params)
            plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=(stop_tok,))
            _, plain_chunks = await _run(llm, PROMPT, plain)
            return "".join(c.text for c in chunks), "".join(c.text for c in plain_chunks), chunks[-1]

    with_stop, without_stop, last = anyio.run(main)
    assert last.finish_reason == "stop"
    assert with_stop == without_stop and with_stop


def test_sessions_share_a_system_prompt_and_an_edited_tail_reprefills_from_the_edit(model_dir):
    system = [(3 * i + 1) % 900 + 1 for i in range(5 * PAGE)]  # five pages of shared prefix

    async def main():
        async with AsyncLLM.start(_config(model_dir, max_running_requests=4)) as llm:
            await _run(llm, system + [7, 8, 9], rid="a")
            results = {}

            async def session(name, tail):
                results[name] = await _run(llm, system + tail, rid=name)

            async with anyio.create_task_group() as tg:  # two sessions at once share the cached pages
                tg.start_soon(session, "b", [10, 11])
                tg.start_soon(session, "c", [12, 13, 14])
            edited = list(system)
            edited[2 * PAGE + 3] += 1  # an edit inside the third page
            results["edited"] = await _run(llm, edited + [7, 8, 9], rid="e")
            return results

    results = anyio.run(main)
    assert results["b"][1][-1].cached_tokens == 5 * PAGE
    assert results["c"][1][-1].cached_tokens == 5 * PAGE
    assert results["edited"][1][-1].cached_tokens == 2 * PAGE  # sharing stops at the edited page
    assert results["b"][0] == _solo(model_dir, system + [10, 11])
    assert results["edited"][0] == _solo(model_dir, [*system[: 2 * PAGE + 3], system[2 * PAGE + 3] + 1,
                                                     *system[2 * PAGE + 4 :], 7, 8, 9])


@pytest.mark.parametrize("policy", ["transfer", "cpu", "static", "hybrid"])
def test_batched_decode_under_every_policy_matches_resident(model_dir, policy):
    """Several sequences decoding together route several tokens per layer through the plan,
    the CPU kernel (grouped by expert across tokens) and the slot GEMM at once."""
    prompts = [PROMPT[: 5 + 3 * i] for i in range(3)]

    async def main(**kw):
        async with AsyncLLM.start(_config(model_dir, max_running_requests=3, **kw)) as llm:
            out = {}

            async def one(i):
                out[i] = (await _run(llm, prompts[i], rid=f"b{i}"))[0]

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(one, i)
            return out

    expected = anyio.run(main)
    moe = MoeConfig(policy=policy, cache_slots=10, params=params_for(policy, {"ratio": 0.5}))
    got = anyio.run(lambda: main(moe=moe))
    assert got == expected
