"""The fused dense path on CUDA (the default) against the reference dense ops, end to end: the
same checkpoint, the same prompts, eager decode. Both bf16 paths are measured against the
reference ops in fp32: the fused path may round differently (fp32 accumulation across fused
steps, one rounding where the reference has several) but must not be further from fp32 than
the reference bf16 path is (up to a factor and an ulp-sized slack), and its greedy token must be
fp32's wherever fp32's top-2 margin exceeds the two paths' errors (random tiny models have
near-ties, where any two bf16 paths may pick differently). (The fused kernels are also checked
one by one against their twins in test_kernels_cuda.py, and graph decode against eager decode
in test_decode_graphs_cuda.py.)"""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig, GraphConfig, KernelConfig, MoeConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.loader.synth import write_synthetic_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _check_against_fp32(got: torch.Tensor, want: torch.Tensor, truth: torch.Tensor, what: str) -> None:
    """got: fused bf16 logits, want: reference bf16 logits, truth: reference fp32 logits [R, V]."""
    fused_err = (got - truth).abs().max().item()
    ref_err = (want - truth).abs().max().item()
    assert fused_err <= 2 * ref_err + 0.02, f"{what}: fused {fused_err:.4f} from fp32, reference bf16 {ref_err:.4f}"
    top2 = truth.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (fused_err + ref_err)
    assert bool((got.argmax(-1) == truth.argmax(-1))[clear].all()), f"{what}: greedy token differs at a clear margin"


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_fused_decode_matches_reference_ops(arch, tmp_path):
    model_dir = write_synthetic_checkpoint(tmp_path / arch, arch, "tiny", seed=5)

    def runner(kernels: str, dtype: str = "bfloat16") -> ModelRunner:
        config = EngineConfig(model=str(model_dir), device="cuda", dtype=dtype, max_model_len=256,
                              moe=MoeConfig(policy="resident"), graphs=GraphConfig(eager=True),
                              kernels=KernelConfig(dense=kernels))
        return ModelRunner(str(model_dir), config, rows=2)

    ref, fused, exact = runner("reference"), runner("fused"), runner("reference", "float32")
    runners = (fused, ref, exact)
    assert fused.model.fused_decode == (arch != "olmoe") and not ref.model.fused_decode
    prompts = [[5, 17, 33, 2, 9, 41, 7], [11, 3, 60, 8]]
    tokens = []
    for row, prompt in enumerate(prompts):
        got, want, truth = (r.prefill(r.row_pages(row), prompt).float() for r in runners)
        _check_against_fp32(got.view(1, -1), want.view(1, -1), truth.view(1, -1), f"prefill row {row}")
        tokens.append(int(truth.argmax()))
    positions = [len(p) for p in prompts]
    for step in range(16):
        got, want, truth = (r.decode([r.row_pages(i) for i in range(2)], tokens, positions).float() for r in runners)
        _check_against_fp32(got, want, truth, f"decode step {step}")
        tokens = truth.argmax(-1).tolist()  # every path is fed fp32's tokens
        positions = [q + 1 for q in positions]
    for r in runners:
        r.close()
