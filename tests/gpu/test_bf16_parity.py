"""bf16 on the GPU: our greedy tokens equal transformers' (eager experts loop) for 32 steps."""

from __future__ import annotations

import pytest

from benchmarks.parity import compare
from freetoken.config import SUPPORTED_ARCHS
from freetoken.loader.synth import write_synthetic_checkpoint

pytest.importorskip("transformers")


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_bf16_greedy_matches_transformers(arch, preset, tmp_path):
    model_dir = write_synthetic_checkpoint(tmp_path / arch, arch, preset, seed=1)
    report = compare(model_dir, "cuda", "bfloat16", steps=32, experts="eager")
    assert report["agree"] == 32, report
