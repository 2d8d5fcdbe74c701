"""bf16 on the GPU: our greedy tokens equal transformers' (eager experts loop) for 32 steps.

gpt-oss matches too since its attention with sinks, its norms and its biased router round where
transformers' eager gpt-oss forward rounds (on the CPU its bf16 logits equal that forward's bit
for bit: tests/test_gpt_oss.py)."""

from __future__ import annotations

import pytest

from benchmarks.parity import compare
from freetoken.config import SUPPORTED_ARCHS
from freetoken.loader.qwen3_5_fields import HYBRID_ARCHS
from freetoken.loader.synth import write_synthetic_checkpoint

pytest.importorskip("transformers")

# (the hybrid Qwens have one small preset, "tiny", with odd head counts and sizes)
CASES = [(a, p) for a in SUPPORTED_ARCHS for p in (("tiny",) if a in HYBRID_ARCHS else ("tiny", "small"))]


@pytest.mark.parametrize("arch, preset", CASES)
def test_bf16_greedy_matches_transformers(arch, preset, tmp_path):
    model_dir = write_synthetic_checkpoint(tmp_path / arch, arch, preset, seed=1)
    report = compare(model_dir, "cuda", "bfloat16", steps=32, experts="eager")
    assert report["agree"] == 32, report


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_hybrid_qwens_served_kernels_match_transformers_in_bf16(arch, tmp_path):
    """The served dense path of the linear-attention families (the fused bundle: the Triton gated
    delta rule and conv, norms, rotary) against transformers' bf16 for 32 steps, on the torch
    expert loop. Not the Triton slot GEMM: it adds a token's K weighted experts in fp32 and rounds
    once where transformers adds them one by one in bf16 (moe/slot_gemm.py), an ulp apart by
    design, which parts these random tiny models' greedy paths within 32 steps (qwen3_5_moe: after
    19, at a top-2 margin of 0.094 among logits up to 9.4, 1.5 bf16 ulps there); its bound against
    the loop is tests/property/test_expert_loop.py's."""
    model_dir = write_synthetic_checkpoint(tmp_path / arch, arch, "tiny", seed=1)
    report = compare(model_dir, "cuda", "bfloat16", steps=32, experts="eager", moe_gemm="torch",
                     dense_kernels="fused")
    assert report["agree"] == 32, report


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_gpt_oss_served_dense_kernels_match_transformers_in_bf16(preset, tmp_path):
    """gpt-oss's served dense path (the fused bundle: the Triton rotary and router linear, its bias
    inside; its norms and sink attention stay torch ops, with no fused kernel that rounds as they
    do) on its one expert GEMM, the torch loop, against transformers' bf16 for 32 steps."""
    model_dir = write_synthetic_checkpoint(tmp_path / "gpt_oss", "gpt_oss", preset, seed=1)
    report = compare(model_dir, "cuda", "bfloat16", steps=32, experts="eager", moe_gemm="torch",
                     dense_kernels="fused")
    assert report["agree"] == 32, report
