"""Shared fixtures; and, where there is no GPU, kernels run in Triton's interpreter.

The switch must be set before the first `@triton.jit` runs, i.e. before any test module imports a
kernel module, hence at conftest import time (one place, so any subset of the suite runs as the
whole suite does).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A factory `(arch, preset="tiny", **overrides) -> Path` for synthetic checkpoints.

    Each distinct set of arguments is written once per test session and shared, so treat
    the returned directory as read-only (copy it before changing files).
    Overrides are those of `write_synthetic_checkpoint` (layers, experts, top_k, seed, ...).
    """
    from freetoken.loader.synth import write_synthetic_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    made: dict[tuple, Path] = {}

    def make(arch: str, preset: str = "tiny", **overrides) -> Path:
        key = (arch, preset, tuple(sorted(overrides.items())))
        if key not in made:
            name = "-".join([arch, preset, *(f"{k}={v}" for k, v in sorted(overrides.items()))])
            made[key] = write_synthetic_checkpoint(root / name, arch, preset, **overrides)
        return made[key]

    return make
