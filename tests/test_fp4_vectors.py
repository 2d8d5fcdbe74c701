"""The MXFP4 block vectors (kernels/cpu/fp4_vectors.py): every byte's two codes decode to twice
their E2M1 values in x's order, through the byte shuffle and through the integer arithmetic
used where the CPU has no SSSE3 (compiled here by switching the lookup off)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from freetoken.kernels.cpu import fp4_vectors
from freetoken.quant.mxfp4 import FP4_VALUES


def _compile_lanes():
    """A fresh compiled function (so the lookup chosen now is the one compiled in): lane j of
    the block at r[o:], picked out by a one-hot x."""
    @njit
    def lane(r, o, j):
        x = np.zeros(32, np.float32)
        x[j] = 1.0
        return fp4_vectors.sum32(fp4_vectors.add_scaled(fp4_vectors.zeros32(), fp4_vectors.fp4_block(r, o),
                                                        fp4_vectors.load_f32x32(x, 0), np.float32(1.0)))
    return lane


@pytest.mark.parametrize("shuffle", [True, False])
def test_every_byte_decodes_to_twice_its_two_values_in_order(shuffle, monkeypatch):
    if shuffle and not fp4_vectors.PSHUFB:
        pytest.skip("this CPU has no SSSE3 byte shuffle")
    monkeypatch.setattr(fp4_vectors, "PSHUFB", shuffle)
    lane = _compile_lanes()
    r = np.arange(256, dtype=np.uint8)  # 16 blocks: every byte value once
    for o in range(0, 256, 16):
        got = [lane(r, o, j) for j in range(32)]
        want = [2 * float(FP4_VALUES[(int(r[o + j // 2]) >> (4 * (j % 2))) & 15]) for j in range(32)]
        assert got == want


def test_the_lookup_table_is_twice_the_format_values():
    assert list(fp4_vectors.TWICE_VALUES) == [2 * float(v) for v in FP4_VALUES]


def test_the_shuffle_follows_the_cpu_numba_targets(monkeypatch):
    from numba.core import config

    monkeypatch.setattr(config, "CPU_FEATURES", "+sse2,+ssse3,+avx2")
    assert fp4_vectors._target_has_pshufb()
    monkeypatch.setattr(config, "CPU_FEATURES", "+neon")
    assert not fp4_vectors._target_has_pshufb()
    monkeypatch.setattr(config, "CPU_FEATURES", None)
    monkeypatch.setattr(config, "CPU_NAME", "generic")  # a portable target: the arithmetic lookup
    assert not fp4_vectors._target_has_pshufb()
