"""The parity corners of tests/test_parity_sweep.py on CUDA in fp32: the fused dense kernels, the
slot GEMMs and the decode graphs against transformers' fp32 forward (on the CPU), same bounds."""

from __future__ import annotations

import pytest

from tests.test_parity_sweep import CORNERS, check_parity

pytest.importorskip("transformers")


# Known failure: graph decode's background fills copy bytes from the bf16 host pool into the
# fp32 slots of an fp32 engine and refuse ("host and slot banks need equal, contiguous rows").
FP32_HYBRID = pytest.mark.xfail(strict=True, raises=ValueError,
                                reason="hybrid graph decode in fp32 on CUDA: byte-copied fills need equal rows")


@pytest.mark.parametrize("name", [pytest.param(n, marks=FP32_HYBRID) if CORNERS[n].policy == "hybrid"
                                  and CORNERS[n].save_dtype == "bfloat16" else n for n in sorted(CORNERS)])
def test_corner_matches_transformers_on_cuda(name, tmp_path):
    check_parity(CORNERS[name], tmp_path, device="cuda")
