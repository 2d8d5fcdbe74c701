"""Programmatic dependent launch changes when a decode step's Triton kernels start, never what
they compute: captured decode steps give the same logits, bit for bit, with it on and off, under
every policy and at batch sizes 1 and 2 (kernels/triton/pdl.py)."""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig, KernelConfig, MoeConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.kernels.triton import pdl
from freetoken.loader.synth import write_synthetic_checkpoint
from freetoken.moe.policy import POLICIES, params_for


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("m") / "qwen3", "qwen3_moe", "tiny", seed=4)


def _logits(model_dir, policy: str, batch: int, on: bool, steps: int = 12) -> list[torch.Tensor]:
    config = EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", max_model_len=256,
                          moe=MoeConfig(policy=policy, cache_slots=None if policy == "resident" else 10,
                                        params=params_for(policy, {"ratio": 0.5})), kernels=KernelConfig(pdl=on))
    runner = ModelRunner(str(model_dir), config, rows=batch)
    try:
        assert runner.graphs is not None
        assert pdl.enabled_for(torch.empty(1, device="cuda")) == on
        prompts = [[7 + r, 2, 8, 1, 8, 2][: 6 - r] for r in range(batch)]
        last = [int(runner.prefill(runner.row_pages(r), p)[0].argmax()) for r, p in enumerate(prompts)]
        pos = [len(p) for p in prompts]
        out = []
        for _ in range(steps):
            logits = runner.decode([runner.row_pages(r) for r in range(batch)], last, pos)
            out.append(logits.float().cpu())
            last = logits.argmax(-1).tolist()
            pos = [q + 1 for q in pos]
        return out
    finally:
        runner.close()
        pdl.set_enabled(True)


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] < 9, reason="PDL needs compute capability 9+")
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_pdl_steps_equal_plain_steps(model_dir, policy, batch):
    with_pdl = _logits(model_dir, policy, batch, on=True)
    plain = _logits(model_dir, policy, batch, on=False)
    for step, (a, b) in enumerate(zip(with_pdl, plain, strict=True)):
        assert torch.equal(a, b), f"{policy}, batch {batch}: step {step} differs with PDL"
