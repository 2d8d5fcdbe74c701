"""Live resize in place: the banks (cache/resizable_rows.py), the slot cache and the KV pool
resized where they are, and the engine resized between requests and under concurrent streams
giving the tokens of a run without resizes (greedy)."""

from __future__ import annotations

import anyio
import pytest
import torch

from freetoken.actors.scheduler import kept_page_map
from freetoken.cache.host_pool import HostExpertPool
from freetoken.cache.resizable_rows import ResizableRows
from freetoken.cache.slot_cache import SlotCache
from freetoken.config import EngineConfig, KvConfig, ModelConfig, MoeConfig, SamplingParams
from freetoken.engine.llm import AsyncLLM
from freetoken.errors import RequestError
from freetoken.models.kv_cache import KVCache
from freetoken.moe.policy import make_policy

PROMPTS = [[(11 * i + 5 * j) % 700 + 3 for j in range(4 + i % 6)] for i in range(8)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
HYBRID = MoeConfig(policy="hybrid", cache_slots=8, params={"ratio": 0.5}, cpu_threads=1)


@pytest.fixture(scope="module")
def model_dir(make_checkpoint):
    return make_checkpoint("qwen3_moe", "tiny", seed=9)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_rows_keep_contents_and_address_and_give_memory_back():
    bank = ResizableRows(2, 1 << 12, (64, 32), torch.float32, "cpu", rows=8)  # 8 KiB rows
    address = bank.tensor.data_ptr()
    bank.tensor.copy_(torch.randn(2, 8, 64, 32))
    kept = bank.tensor[:, :5].clone()
    bank.resize(3000)  # ~47 MiB more: committed, zeros
    assert bank.tensor.data_ptr() == address and bank.tensor.shape == (2, 3000, 64, 32)
    assert torch.equal(bank.tensor[:, :5], kept) and not bank.tensor[:, 8:].any()
    bank.tensor.fill_(1.0)  # touch every page
    touched = _rss_bytes()
    bank.resize(5)
    assert touched - _rss_bytes() > 40 << 20  # the tail is given back to the system, not kept
    assert bank.tensor.data_ptr() == address and torch.equal(bank.tensor, torch.ones(2, 5, 64, 32))
    bank.resize(9)
    assert not bank.tensor[:, 5:].any()  # rows given back and committed again read as zeros
    with pytest.raises(ValueError):
        bank.resize(1 << 13)


def test_refused_commit_changes_nothing(monkeypatch):
    bank = ResizableRows(3, 100, (16,), torch.float32, "cpu", rows=4)
    bank.tensor.copy_(torch.arange(3 * 4 * 16, dtype=torch.float32).view(3, 4, 16))
    before = bank.tensor.clone()
    calls = []
    real = type(bank._memory).commit

    def commit_then_refuse(self, offset, nbytes):  # the second group's commit is refused
        calls.append(offset)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("refused")
        real(self, offset, nbytes)

    monkeypatch.setattr(type(bank._memory), "commit", commit_then_refuse)
    with pytest.raises(torch.OutOfMemoryError):
        bank.resize(100)
    assert bank.rows == 4 and torch.equal(bank.tensor, before)


def test_slot_cache_shrinks_in_place_keeping_the_most_recent_experts(model_dir):
    cfg = ModelConfig.from_dir(model_dir)
    pool = HostExpertPool.load(model_dir, cfg)
    E, K = cfg.num_experts, cfg.top_k
    cache = SlotCache(pool, 12, make_policy("transfer"), 0, "cpu", torch.float32, planner="reference")
    gen = torch.Generator().manual_seed(3)
    for _ in range(6):
        for layer in range(cfg.num_layers):
            plan = cache.plan(layer, torch.randint(0, E, (3, K), generator=gen))
            cache.fill(plan.copies + plan.background)
    before = cache.reference_state()
    address = cache.w13.data_ptr()
    recent = sorted((before.last_used[s], f) for s, f in enumerate(before.fid_of_slot) if f >= 0)[-5:]
    cache.resize(5)
    state = cache.reference_state()
    state.check()
    assert cache.w13.data_ptr() == address and cache.w13.shape[0] == 5 and state.num_slots == 5
    assert sorted((state.last_used[s], f) for s, f in enumerate(state.fid_of_slot)) == recent
    assert state.step == before.step and state.last_active == before.last_active
    for slot, fid in enumerate(state.fid_of_slot):  # moved experts hold their own weights
        assert torch.equal(cache.w13[slot], pool.w13[fid]) and torch.equal(cache.w2[slot], pool.w2[fid])
    cache.resize(cfg.num_layers * E)
    grown = cache.reference_state()
    assert grown.fid_of_slot[:5] == state.fid_of_slot and set(grown.fid_of_slot[5:]) == {-1}
    assert not cache.w13[5:].any() and cache.w13.data_ptr() == address


def test_kv_pool_moves_only_pages_past_the_new_end():
    cache = KVCache(2, 10, 4, 1, 2, torch.float32, "cpu")
    cache.k.copy_(torch.randn_like(cache.k))
    cache.v.copy_(torch.randn_like(cache.v))
    kept = [1, 7, 9, 3]
    mapping = kept_page_map(kept, 5)
    assert mapping[1] == 1 and mapping[3] == 3 and sorted(mapping.values()) == [0, 1, 2, 3]
    pages = {p: (cache.k[:, 4 * p:4 * p + 4].clone(), cache.v[:, 4 * p:4 * p + 4].clone()) for p in kept}
    address = cache.k.data_ptr()
    cache.resize(5, mapping)
    assert cache.k.shape[1] == 20 and cache.k.data_ptr() == address and cache.num_pages == 5
    for old, new in mapping.items():
        assert torch.equal(cache.k[:, 4 * new:4 * new + 4], pages[old][0])
        assert torch.equal(cache.v[:, 4 * new:4 * new + 4], pages[old][1])
    with pytest.raises(ValueError, match="no kept page"):
        cache.resize(5, {0: 1, 1: 2})  # a page moved onto one still to be read


def _config(model_dir, **kw) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=256,
                        max_running_requests=8, moe=HYBRID, **kw)


class Progress:
    """Chunks received by every stream together; `reach(n)` returns once n have come."""

    def __init__(self) -> None:
        self.count = 0
        self.waiters: list[tuple[int, anyio.Event]] = []

    def tick(self) -> None:
        self.count += 1
        for n, event in self.waiters:
            if self.count >= n:
                event.set()

    async def reach(self, n: int) -> None:
        if self.count < n:
            event = anyio.Event()
            self.waiters.append((n, event))
            await event.wait()


async def _stream(llm, i: int, tokens: dict, progress: Progress | None = None) -> None:
    out = []
    async for chunk in llm.generate(PROMPTS[i], GREEDY, f"r{i}"):
        out += chunk.token_ids
        if progress is not None:
            progress.tick()
    tokens[i] = out


def _reference(model_dir) -> dict:
    async def main():
        tokens: dict = {}
        async with AsyncLLM.start(_config(model_dir)) as llm:
            async with anyio.create_task_group() as tg:
                for i in range(len(PROMPTS)):
                    tg.start_soon(_stream, llm, i, tokens)
        return tokens

    return anyio.run(main)


@pytest.fixture(scope="module")
def reference(model_dir):
    return _reference(model_dir)


def test_resizes_under_concurrent_streams_keep_every_token(model_dir, reference):
    """Eight greedy streams run while the expert cache and the KV pool shrink and grow (shrink
    one while growing the other, both ways): every stream gets the tokens it gets alone."""
    sizes = [(4, 8 * 256), (14, 3 * 256), (2, 6 * 256), (10, 12 * 256)]

    async def main():
        tokens: dict = {}
        progress = Progress()
        statuses = []
        async with AsyncLLM.start(_config(model_dir, kv=KvConfig(tokens=8 * 256))) as llm:
            async with anyio.create_task_group() as tg:
                for i in range(len(PROMPTS)):
                    tg.start_soon(_stream, llm, i, tokens, progress)
                for n, (slots, kv) in enumerate(sizes):  # (8 streams x 14 chunks: every threshold comes)
                    await progress.reach(6 + 8 * n)
                    statuses.append(await llm.resize_cache(moe_slots=slots, kv_tokens=kv))
            after = [t async for c in llm.generate(PROMPTS[0], GREEDY, "after") for t in c.token_ids]
        return tokens, statuses, after

    tokens, statuses, after = anyio.run(main)
    assert [(s["expert_slots"], s["kv_tokens"]) for s in statuses] == sizes
    assert tokens == reference and after == reference[0]


def test_resizes_between_requests_and_a_refusal_change_nothing(model_dir, reference):
    async def main():
        async with AsyncLLM.start(_config(model_dir)) as llm:
            first = [t async for c in llm.generate(PROMPTS[1], GREEDY, "a") for t in c.token_ids]
            before = await llm.cache_status()
            with pytest.raises(RequestError, match="free after the headroom"):
                await llm.resize_cache(moe_slots=4, kv_tokens=2**40)  # a shrink with an impossible growth
            unchanged = await llm.cache_status()
            shrunk = await llm.resize_cache(moe_slots=3, kv_tokens=2 * 256)
            second = [t async for c in llm.generate(PROMPTS[1], GREEDY, "b") for t in c.token_ids]
            grown = await llm.resize_cache(moe_slots=14, kv_tokens=9 * 256)
            third = [t async for c in llm.generate(PROMPTS[2], GREEDY, "c") for t in c.token_ids]
            return first, before, unchanged, shrunk, second, grown, third

    first, before, unchanged, shrunk, second, grown, third = anyio.run(main)
    assert unchanged == before  # refused before anything changed
    assert (shrunk["expert_slots"], shrunk["kv_tokens"]) == (3, 512)
    assert (grown["expert_slots"], grown["kv_tokens"]) == (14, 9 * 256)
    assert first == second == reference[1] and third == reference[2]
