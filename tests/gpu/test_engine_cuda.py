"""The whole engine on CUDA: greedy through the actors equals the direct runner loop."""

from __future__ import annotations

import anyio

from benchmarks.parity import ours_greedy
from freetoken.config import EngineConfig, SamplingParams
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
