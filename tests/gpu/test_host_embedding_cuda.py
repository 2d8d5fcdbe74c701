"""On CUDA the untied token embedding table stays in pinned host memory and the device gathers
its rows (kernels/triton/host_embedding.py): eager prefill and captured decode compute what the
same engine computes with the table on the device."""

from __future__ import annotations

import torch

from freetoken.config import EngineConfig, MoeConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.loader.synth import write_synthetic_checkpoint


def _steps(runner: ModelRunner, prompt: list[int], steps: int = 8) -> torch.Tensor:
    logits = [runner.prefill(runner.row_pages(0), prompt)[0]]
    for i in range(steps):
        token = int(logits[-1].argmax())
        logits.append(runner.decode([runner.row_pages(0)], [token], [len(prompt) + i])[0])
    return torch.stack(logits).float().cpu()


def test_the_embedding_table_stays_on_the_host_and_computes_the_same(tmp_path):
    model_dir = write_synthetic_checkpoint(tmp_path / "m", "qwen3_moe", "small", seed=3)
    config = EngineConfig(device="cuda", dtype="bfloat16", max_model_len=256, moe=MoeConfig(policy="resident"))
    runner = ModelRunner(str(model_dir), config, rows=1)
    table = runner.weights.embed
    assert table.device.type == "cpu" and table.is_pinned()
    assert runner.status()["dense_host_bytes"] == table.nbytes
    prompt = list(range(5, 300, 7))
    on_host = _steps(runner, prompt)
    runner.weights.embed = table.cuda()  # the same engine, the table on the device (torch's lookup)
    if runner.graphs is not None:
        runner.graphs.invalidate()
    on_device = _steps(runner, prompt)
    runner.close()
    assert torch.equal(on_host, on_device)
