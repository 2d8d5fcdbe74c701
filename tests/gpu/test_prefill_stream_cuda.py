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


def test_a_prefill_after_decode_copies_cached_experts_on_the_device(tmp_path):
    """With slots past the two buffers, decode fills them; the next streamed prefill copies those
    experts into its buffers device to device (ordered after the fills on the copy stream), keeps
    them cached, and computes resident's logits."""
    import torch

    model_dir = write_synthetic_checkpoint(tmp_path / "m", "qwen3_moe", "small", seed=3)
    E = ModelConfig.from_dir(model_dir).num_experts
    prompt, second = list(range(5, 400, 3)), list(range(900, 500, -3))
    base = dict(device="cuda", dtype="float32", max_model_len=256, kernels=KernelConfig(moe_gemm="torch"))
    resident = ModelRunner(str(model_dir), EngineConfig(**base, moe=MoeConfig(policy="resident")), rows=1)
    _greedy(resident, prompt)
    expected = resident.prefill(resident.row_pages(0), second)
    resident.close()
    config = EngineConfig(**base, moe=MoeConfig(policy="transfer", cache_slots=3 * E, prefill_stream_min_tokens=64))
    runner = ModelRunner(str(model_dir), config, rows=1)
    _greedy(runner, prompt)
    counts = runner.model.backend.stream_counts
    assert counts.on_device == 0
    logits = runner.prefill(runner.row_pages(0), second)
    assert counts.on_device > 0
    assert (logits - expected).abs().max() / expected.abs().max() < 1e-4
    runner.slots.reference_state().check()
    runner.close()
    torch.cuda.synchronize()
