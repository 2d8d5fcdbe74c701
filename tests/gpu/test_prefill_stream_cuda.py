"""Prefill layer streaming on CUDA (copy stream, events, two buffers) computes what resident does."""

from __future__ import annotations

from freetoken.config import EngineConfig, KernelConfig, ModelConfig, MoeConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.loader.synth import write_synthetic_checkpoint


def _greedy(runner, prompt, steps=16):
    tokens = [int(runner.prefill(runner.row_pages(0), prompt).argmax())]
    while len(tokens) < steps:
        tokens.append(int(runner.decode([runner.row_pages(0)], [tokens[-1]], [len(prompt) + len(tokens) - 1]).argmax()))
    return tokens


def test_streamed_prefill_matches_resident_on_cuda(tmp_path):
    model_dir = write_synthetic_checkpoint(tmp_path / "m", "qwen3_moe", "small", seed=3)
    E = ModelConfig.from_dir(model_dir).num_experts
    prompt = list(range(5, 400, 3))  # 132 tokens: streamed
    base = dict(device="cuda", dtype="float32", max_model_len=256, kernels=KernelConfig(moe_gemm="torch"))
    resident = ModelRunner(str(model_dir), EngineConfig(**base, moe=MoeConfig(policy="resident")), rows=1)
    expected = _greedy(resident, prompt)
    resident.close()
    for slots in (E, 2 * E):
        config = EngineConfig(**base, moe=MoeConfig(policy="transfer", cache_slots=slots, prefill_stream_min_tokens=64))
        runner = ModelRunner(str(model_dir), config, rows=1)
        assert _greedy(runner, prompt) == expected, f"{slots} slots"
        assert runner.model.backend.streamer.layers_streamed > 0
        runner.close()
