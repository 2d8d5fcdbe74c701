"""bf16 on the GPU: our greedy tokens equal transformers' (eager experts loop) for 32 steps.

gpt-oss is a known failure: its greedy tokens part from transformers' after 4-11 steps, where
the two candidates lie within a few bf16 steps of each other (the same on the CPU in bf16, while
fp32 agrees: tests/test_gpt_oss.py). Some rounding point of transformers' eager gpt-oss path
(its sink softmax, the biased projections) is not yet matched; the strict mark fails once it is."""

from __future__ import annotations

import pytest

from benchmarks.parity import compare
from freetoken.config import SUPPORTED_ARCHS
from freetoken.loader.qwen3_5_fields import HYBRID_ARCHS
from freetoken.loader.synth import write_synthetic_checkpoint

pytest.importorskip("transformers")

GPT_OSS_BF16 = pytest.mark.xfail(strict=True, raises=AssertionError,
                                 reason="gpt-oss bf16 rounding points not yet matched to transformers' eager path")


# (the hybrid Qwens have one small preset, "tiny", with odd head counts and sizes)
CASES = [(a, p) for a in SUPPORTED_ARCHS for p in (("tiny",) if a in HYBRID_ARCHS else ("tiny", "small"))]


@pytest.mark.parametrize("arch, preset", [pytest.param(a, p, marks=GPT_OSS_BF16) if a == "gpt_oss" else (a, p)
                                          for a, p in CASES])
def test_bf16_greedy_matches_transformers(arch, preset, tmp_path):
    model_dir = write_synthetic_checkpoint(tmp_path / arch, arch, preset, seed=1)
    report = compare(model_dir, "cuda", "bfloat16", steps=32, experts="eager")
    assert report["agree"] == 32, report


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_hybrid_qwens_served_kernels_match_transformers_in_bf16(arch, tmp_path):
    """The served path of the linear-attention families (fused dense kernels, the Triton gated
    delta rule and conv, the Triton slot GEMM) against transformers' bf16 for 32 steps."""
    model_dir = write_synthetic_checkpoint(tmp_path / arch, arch, "tiny", seed=1)
    report = compare(model_dir, "cuda", "bfloat16", steps=32, experts="eager", moe_gemm="triton",
                     dense_kernels="fused")
    assert report["agree"] == 32, report
