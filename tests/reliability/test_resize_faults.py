"""Fault injection: the device refuses memory in the middle of a live resize.

The cache that shrinks goes first (cache/live_resize.py), so the refusal comes from the growth
after it; the resize must be undone (both caches back at their old sizes), its caller told
clearly why, and the stream in flight and the next request must finish with the tokens of an
engine that was never resized (greedy)."""

from __future__ import annotations

import anyio
import pytest
import torch

from freetoken.cache import resizable_rows
from freetoken.config import EngineConfig, KvConfig, MoeConfig, SamplingParams
from freetoken.engine.llm import AsyncLLM
from freetoken.errors import RequestError

PROMPT = [5, 9, 14, 200, 31, 7, 88, 123, 42, 17, 3]
NEXT = [8, 1, 44, 90, 12]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
START = dict(moe_slots=8, kv_tokens=6 * 256)


@pytest.fixture(scope="module")
def model_dir(make_checkpoint):
    return make_checkpoint("qwen3_moe", "tiny", seed=12)


def _config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=256,
                        moe=MoeConfig(cpu_threads=1, policy="hybrid", cache_slots=START["moe_slots"],
                                      params={"ratio": 0.5}), kv=KvConfig(tokens=START["kv_tokens"]))


async def _tokens(llm, prompt, rid) -> list[int]:
    return [t async for c in llm.generate(prompt, GREEDY, rid) for t in c.token_ids]


@pytest.fixture(scope="module")
def reference(model_dir):
    async def main():
        async with AsyncLLM.start(_config(model_dir)) as llm:
            return await _tokens(llm, PROMPT, "a"), await _tokens(llm, NEXT, "b")

    return anyio.run(main)


class RefuseNextCommit:
    """Arms the host reservation to refuse its next commit (the allocation a growth makes)."""

    def __init__(self, monkeypatch, error: type[Exception]) -> None:
        self.armed = False
        self.refused = 0
        real = resizable_rows._HostReservation.commit

        def commit(reservation, offset, nbytes):
            if self.armed:
                self.armed = False
                self.refused += 1
                raise error("injected: the allocator refused")
            real(reservation, offset, nbytes)

        monkeypatch.setattr(resizable_rows._HostReservation, "commit", commit)


# (shrink the expert cache and grow KV; grow the expert cache and shrink KV)
@pytest.mark.parametrize("sizes", [dict(moe_slots=3, kv_tokens=12 * 256), dict(moe_slots=14, kv_tokens=2 * 256)])
@pytest.mark.parametrize("error", [torch.OutOfMemoryError, RuntimeError])
def test_a_refused_allocation_mid_resize_rolls_back_and_serving_goes_on(model_dir, reference, monkeypatch,
                                                                      sizes, error):
    fault = RefuseNextCommit(monkeypatch, error)

    async def main():
        async with AsyncLLM.start(_config(model_dir)) as llm:
            before = await llm.cache_status()
            tokens, failure = [], None
            async for chunk in llm.generate(PROMPT, GREEDY, "in-flight"):
                tokens += chunk.token_ids
                if len(tokens) == 4:  # mid-stream
                    fault.armed = True
                    try:
                        await llm.resize_cache(**sizes)
                    except RequestError as exc:
                        failure = exc
            after = await llm.cache_status()
            following = await _tokens(llm, NEXT, "next")
            resized = await llm.resize_cache(**sizes)  # the same resize, not refused this time
            return before, failure, after, tokens, following, resized

    before, failure, after, tokens, following, resized = anyio.run(main)
    assert fault.refused == 1
    assert failure is not None, "the resize caller must get the refusal"
    message = str(failure)
    assert "refused the memory" in message and "back at their old sizes" in message and "injected" in message
    assert failure.param in ("moe_slots", "kv_tokens")
    for key in ("expert_slots", "kv_tokens", "kv_pages", "max_model_len", "expert_slot_bytes", "kv_bytes"):
        assert after[key] == before[key], key
    assert (before["expert_slots"], before["kv_tokens"]) == tuple(START.values())
    assert tokens == reference[0] and following == reference[1]
    assert (resized["expert_slots"], resized["kv_tokens"]) == tuple(sizes.values())
