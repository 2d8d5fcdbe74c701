"""The parity corners of tests/test_parity_sweep.py on CUDA in fp32: the fused dense kernels, the
slot GEMMs and the decode graphs against transformers' fp32 forward (on the CPU), same bounds.
Corners saved in bf16 and computed in fp32 fill fp32 slots from the bf16 pool: the fill kernel
widens the rows, and hybrid's background fills leave the copy engine (which moves bytes) for it."""

from __future__ import annotations

import pytest

from tests.test_parity_sweep import CORNERS, check_parity

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(CORNERS))
def test_corner_matches_transformers_on_cuda(name, tmp_path):
    check_parity(CORNERS[name], tmp_path, device="cuda")
