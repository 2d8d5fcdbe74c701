"""The fused dense path on CUDA (the default) against the reference dense ops, end to end: the
same checkpoint, the same prompts, eager decode; logits within bf16 tolerance, the same greedy
tokens. (The fused kernels are also checked one by one against their twins in
test_kernels_cuda.py, and graph decode against eager decode in test_decode_graphs_cuda.py.)"""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.loader.synth import write_synthetic_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_fused_decode_matches_reference_ops(arch, tmp_path):
    model_dir = write_synthetic_checkpoint(tmp_path / arch, arch, "tiny", seed=5)

    def runner(kernels: str) -> ModelRunner:
        config = EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", max_model_len=256,
                              moe_policy="resident", eager=True, dense_kernels=kernels)
        return ModelRunner(str(model_dir), config, rows=2)

    ref, fused = runner("reference"), runner("fused")
    assert fused.model.fused_decode == (arch != "olmoe") and not ref.model.fused_decode
    prompts = [[5, 17, 33, 2, 9, 41, 7], [11, 3, 60, 8]]
    tokens = []
    for row, prompt in enumerate(prompts):
        want = ref.prefill(ref.row_pages(row), prompt)
        got = fused.prefill(fused.row_pages(row), prompt)
        torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)
        tokens.append(int(want.argmax()))
    positions = [len(p) for p in prompts]
    pages = [ref.row_pages(r) for r in range(2)]
    for step in range(16):
        want = ref.decode(pages, tokens, positions)
        got = fused.decode(pages, tokens, positions)
        torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05, msg=f"step {step}")
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), step
        tokens = want.argmax(-1).tolist()
        positions = [q + 1 for q in positions]
    ref.close()
    fused.close()
