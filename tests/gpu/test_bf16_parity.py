"""bf16 on the GPU: our greedy tokens equal transformers' (eager experts loop) for 32 steps.

gpt-oss is a known failure: its greedy tokens part from transformers' after 4-11 steps, where
the two candidates lie within a few bf16 steps of each other (the same on the CPU in bf16, while
fp32 agrees: tests/test_gpt_oss.py). Some rounding point of transformers' eager gpt-oss path
(its sink softmax, the biased projections) is not yet matched; the strict mark fails once it is."""

from __future__ import annotations

import pytest

from benchmarks.parity import compare
from freetoken.config import SUPPORTED_ARCHS
from freetoken.loader.synth import write_synthetic_checkpoint

pytest.importorskip("transformers")

GPT_OSS_BF16 = pytest.mark.xfail(strict=True, raises=AssertionError,
                                 reason="gpt-oss bf16 rounding points not yet matched to transformers' eager path")


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("arch", [pytest.param(a, marks=GPT_OSS_BF16) if a == "gpt_oss" else a
                                  for a in SUPPORTED_ARCHS])
def test_bf16_greedy_matches_transformers(arch, preset, tmp_path):
    model_dir = write_synthetic_checkpoint(tmp_path / arch, arch, preset, seed=1)
    report = compare(model_dir, "cuda", "bfloat16", steps=32, experts="eager")
    assert report["agree"] == 32, report
