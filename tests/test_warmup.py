"""The start-up warm-up (engine/warmup.py): it runs before the engine is ready, and afterwards the
engine looks to its users exactly as a fresh one that never warmed up, and answers the same."""

from __future__ import annotations

import anyio
import pytest

from freetoken.config import EngineConfig, MoeConfig, SamplingParams, SchedulerConfig
from freetoken.engine import warmup
from freetoken.engine.llm import AsyncLLM
from freetoken.engine.model_runner import ModelRunner
from freetoken.loader.synth import write_synthetic_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [100, 200, 300, 400, 12, 13, 14]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("warmup"), "qwen3_moe", "tiny", seed=5)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):  # linear-attention layers: recurrent-state slots
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("warmup_next"), "qwen3_next", "tiny", seed=5)


def _config(model_dir, warm: bool, max_len: int = 128, prefill_chunk: int = 8192) -> EngineConfig:
    # hybrid on 8 slots: the warm-up misses, fetches and routes to the CPU, all of it to be forgotten
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=max_len,
                        max_running_requests=3, warmup=warm, scheduler=SchedulerConfig(prefill_chunk=prefill_chunk),
                        moe=MoeConfig(policy="hybrid", cache_slots=8, params={"ratio": 0.5}, cpu_threads=1))


def _seen_at_start(model_dir, warm: bool) -> dict:
    """What users and the scheduler see of a just-started engine."""
    async def main():
        async with AsyncLLM.start(_config(model_dir, warm)) as llm:
            states, prefix = llm.runner.states, llm.scheduler.prefix
            return {
                "health": llm.health(), "metrics": llm.metrics(), "cache": await llm.cache_status(),
                "prefix_nodes": len(list(prefix.nodes())), "free_pages": sorted(prefix.free),
                "state_slots_in_acquire_order": None if states is None else [
                    states.acquire() for _ in range(states.free)],
            }

    return anyio.run(main)


@pytest.mark.parametrize("model", ["moe_dir", "hybrid_dir"])
def test_a_warmed_engine_starts_as_a_fresh_one(model, request):
    model_dir = request.getfixturevalue(model)
    assert _seen_at_start(model_dir, warm=True) == _seen_at_start(model_dir, warm=False)


def test_the_warm_up_ran_the_expert_paths_and_its_counts_were_forgotten(moe_dir, monkeypatch):
    """The equality above is no accident of an idle warm-up: before its counters are zeroed, the
    warm-up's plans have missed and routed to the CPU."""
    seen = {}
    forget = warmup.forget_counters

    def spy(runner):
        status = runner.status()
        seen.update(misses=status["misses"], cpu_routes=status["cpu_routes"])
        forget(runner)

    monkeypatch.setattr(warmup, "forget_counters", spy)
    runner = ModelRunner(str(moe_dir), _config(moe_dir, warm=True), rows=3)
    try:
        report = warmup.warm_up(runner, _config(moe_dir, warm=True))
        after = runner.status()
    finally:
        runner.close()
    assert seen["misses"] > 0 and seen["cpu_routes"] > 0
    assert after["misses"] == after["hits"] == after["cpu_routes"] == after["experts_fetched"] == 0
    assert report.prefill_lengths == [1, 5, 16, 64, 65] and report.batch_sizes == [1, 2, 3] and not report.key_buckets


def _generate_all(model_dir, warm: bool) -> list[list[int]]:
    """The prompts together (batched decode), then the first again (it may reuse cached pages)."""
    async def one(llm, prompt, rid, out):
        out[rid] = [t async for c in llm.generate(prompt, GREEDY, rid) for t in c.token_ids]

    async def main():
        out: dict[str, list[int]] = {}
        async with AsyncLLM.start(_config(model_dir, warm)) as llm:
            async with anyio.create_task_group() as tg:
                for i, prompt in enumerate(PROMPTS):
                    tg.start_soon(one, llm, prompt, f"r{i}", out)
            await one(llm, PROMPTS[0], "again", out)
        return [out[k] for k in sorted(out)]

    return anyio.run(main)


@pytest.mark.parametrize("model", ["moe_dir", "hybrid_dir"])
def test_requests_after_the_warm_up_get_the_tokens_they_get_without(model, request):
    model_dir = request.getfixturevalue(model)
    assert _generate_all(model_dir, warm=True) == _generate_all(model_dir, warm=False)


def test_the_warm_up_logs_one_line_and_no_warmup_skips_it(moe_dir, capsys):
    async def start(warm: bool):
        async with AsyncLLM.start(_config(moe_dir, warm)):
            pass

    anyio.run(start, True)
    lines = [line for line in capsys.readouterr().err.splitlines() if "warm-up" in line]
    assert len(lines) == 1 and lines[0].startswith("[freetoken] warm-up: ")
    assert lines[0].endswith("s (prefill 1, 5, 16, 64, 65 tokens, decode at batch 1, 2, 3)")
    anyio.run(start, False)
    assert "warm-up" not in capsys.readouterr().err


def test_no_warmup_is_the_flag_of_serve_and_generate():
    from freetoken.__main__ import build_parser
    from freetoken.cli_args import engine_config_from

    for command in (["serve"], ["generate", "--prompt", "x"]):
        assert engine_config_from(build_parser().parse_args(command)).warmup
        assert not engine_config_from(build_parser().parse_args([*command, "--no-warmup"])).warmup


def test_short_contexts_and_chunks_shorten_or_drop_the_prompts(moe_dir):
    """The long prompt only where a prefill chunk that long can occur; the short one leaves room
    for the decode position after it."""
    runner = ModelRunner(str(moe_dir), _config(moe_dir, warm=True, max_len=4), rows=1)
    try:
        assert warmup.warm_prefill_lengths(runner, _config(moe_dir, warm=True, max_len=4)) == [1]
        report = warmup.warm_up(runner, _config(moe_dir, warm=True, max_len=4))
    finally:
        runner.close()
    assert report.prefill_lengths == [1] and report.batch_sizes == [1]
    small_chunks = _config(moe_dir, warm=True, prefill_chunk=32)
    runner = ModelRunner(str(moe_dir), small_chunks, rows=1)
    try:
        assert warmup.warm_prefill_lengths(runner, small_chunks) == [1, 5, 16]
    finally:
        runner.close()


def test_fused_kernels_warm_a_decode_position_in_each_key_bucket_up_to_the_context():
    """Graphs are captured per (batch, key bucket) and the fused decode attention's key splits are
    compile-time constants: one position per bucket a step can meet, none past the context."""
    from types import SimpleNamespace

    from freetoken.engine.decode_graphs import key_bucket

    for max_len, buckets in ((64, [128]), (129, [128, 256]), (300, [128, 256, 512]),
                             (4096, [128, 256, 512, 1024, 2048, 4096])):
        positions = warmup.warm_decode_positions(SimpleNamespace(fused=True, max_len=max_len), 16)
        assert [key_bucket(p + 1) for p in positions] == buckets and max(positions) < max_len
    assert warmup.warm_decode_positions(SimpleNamespace(fused=False, max_len=4096), 16) == [16]  # exact lengths
    report = warmup.WarmupReport(2.5, [1, 5, 16, 64, 65], [1, 2, 4], [128, 256, 512])
    assert report.summary() == ("warm-up: 2.5 s (prefill 1, 5, 16, 64, 65 tokens, decode at batch 1, 2, 4, "
                                "keys 128 to 512)")
