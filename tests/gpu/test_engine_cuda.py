"""The whole engine on CUDA: greedy through the actors equals the direct runner loop; after the start-up
warm-up, first requests capture no decode graph."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from benchmarks.parity import ours_greedy
from freetoken.config import EngineConfig, MoeConfig, SamplingParams
from freetoken.engine.llm import AsyncLLM
from freetoken.loader.synth import write_synthetic_checkpoint


def test_engine_on_cuda(tmp_path):
    model_dir = write_synthetic_checkpoint(tmp_path / "m", "qwen3_moe", "tiny", seed=2)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def main():
        config = EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", max_model_len=64)
        async with AsyncLLM.start(config) as llm:
            return [t async for c in llm.generate(prompt, params, "g") for t in c.token_ids]

    # the same kernels as the engine's defaults (Triton slot GEMM, fused dense ops, graphs)
    direct = ours_greedy(model_dir, prompt, 24, "cuda", "bfloat16", moe_gemm="auto", dense_kernels="fused")[0]
    assert anyio.run(main) == direct


def _first_requests(config: EngineConfig, prompts: list[list[int]]):
    """One request alone, then three together (batches 1, 2, 3 padded to 4), each 140 tokens: the
    decode graphs' status at start and after them, and each request's greedy tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=140, ignore_eos=True)  # (key buckets 128 and 256)

    async def main():
        out = {}

        async def one(llm, i):
            out[i] = [t async for c in llm.generate(prompts[i], params, f"r{i}") for t in c.token_ids]

        async with AsyncLLM.start(config) as llm:
            at_start = (await llm.cache_status())["decode_graphs"]
            await one(llm, 0)
            async with anyio.create_task_group() as tg:
                for i in (1, 2, 3):
                    tg.start_soon(one, llm, i)
            return at_start, (await llm.cache_status())["decode_graphs"], [out[i] for i in range(len(prompts))]

    return anyio.run(main)


HYBRID = MoeConfig(policy="hybrid", cache_slots=8, params={"ratio": 0.5}, cpu_threads=2)


@pytest.mark.parametrize("moe", [MoeConfig(), HYBRID], ids=["auto", "hybrid"])
def test_the_first_requests_after_start_capture_no_graph(tmp_path, moe):
    """The warm-up (engine/warmup.py) captured every (batch size, key bucket) graph before start
    returned: the first requests' decode steps only replay, and no shape failed to capture or ran
    eagerly. With every expert resident (auto) their tokens are those of an engine without the
    warm-up (hybrid's placement after the warm-up differs, and bf16 CPU and GPU experts round
    apart)."""
    model_dir = write_synthetic_checkpoint(tmp_path / "m", "qwen3_moe", "tiny", seed=2)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8], [1, 6, 1, 8, 0, 3], [4, 6, 6, 9, 2]]
    # a context of 300: key buckets 128, 256 and 512; prefills of 64 and 65 tokens stream
    config = EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", max_model_len=300,
                          max_running_requests=4, moe=moe)
    at_start, after, tokens = _first_requests(config, prompts)
    assert at_start["batch_sizes"] == [1, 2, 4] and at_start["capture_failures"] == 0
    assert at_start["captured"] == [[b, k] for b in (1, 2, 4) for k in (128, 256, 512)]
    assert after["captured"] == at_start["captured"]  # nothing captured after start
    assert after["capture_failures"] == 0 and after["eager_shapes"] == []
    if moe.policy == "auto":
        cold = _first_requests(msgspec.structs.replace(config, warmup=False), prompts)
        assert cold[0]["captured"] == [] and cold[1]["captured"]  # what the warm-up spared the requests
        assert {tuple(s) for s in cold[1]["captured"]} <= {tuple(s) for s in at_start["captured"]}
        assert tokens == cold[2]
