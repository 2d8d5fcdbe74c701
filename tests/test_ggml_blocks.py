"""Our GGML dequantization is bit-exact against the `gguf` package's on random valid blocks."""

from __future__ import annotations

import numpy as np
import pytest

from freetoken.quant.ggml_blocks import BLOCK_SIZES, GGMLType, dequantize, parse_type, row_bytes

gguf = pytest.importorskip("gguf")

# Byte offsets of each block's f16 scale fields: random bytes there could be inf/NaN.
_F16_FIELDS = {GGMLType.Q8_0: (0,), GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,),
               GGMLType.MXFP4: ()}
# MXFP4's exponent byte: subnormal scales (0, 1) included, the top few left out (6 * 2^127 overflows)
_MXFP4_EXPONENTS = (0, 251)


def _random_rows(qtype: GGMLType, rows: int, n: int, rng: np.random.Generator) -> np.ndarray:
    if qtype == GGMLType.F32:
        return rng.standard_normal((rows, n), dtype=np.float32).view(np.uint8)
    if qtype == GGMLType.F16:
        return rng.standard_normal((rows, n)).astype(np.float16).view(np.uint8)
    if qtype == GGMLType.BF16:
        bits = rng.standard_normal((rows, n), dtype=np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    data = rng.integers(0, 256, (rows, row_bytes(qtype, n)), dtype=np.uint8)
    blocks = data.reshape(-1, BLOCK_SIZES[qtype][1])
    for at in _F16_FIELDS[qtype]:
        scale = rng.uniform(-3, 3, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, at : at + 2] = scale.view(np.uint8)
    if qtype == GGMLType.MXFP4:
        blocks[:, 0] = rng.integers(*_MXFP4_EXPONENTS, blocks.shape[0], dtype=np.uint8)
    return data


@pytest.mark.parametrize("qtype", list(GGMLType), ids=lambda t: t.name)
def test_dequantize_is_bit_exact_against_gguf(qtype):
    rng = np.random.default_rng(int(qtype))
    data = _random_rows(qtype, 3, 512, rng).reshape(3, 1, -1)
    ours = dequantize(qtype, data, 512)
    ref = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(int(qtype)))
    assert ours.shape == (3, 1, 512) and ours.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), np.asarray(ref, dtype=np.float32).view(np.uint32))


def test_block_table_matches_gguf():
    for qtype, sizes in BLOCK_SIZES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(qtype))] == sizes


def test_row_bytes_and_parse_type():
    assert row_bytes(GGMLType.Q4_K, 2048) == 8 * 144
    assert row_bytes(GGMLType.Q8_0, 64) == 68
    assert parse_type("q8_0") is GGMLType.Q8_0 and parse_type(" Q4_K ") is GGMLType.Q4_K
    with pytest.raises(ValueError, match="Q6_K row holds whole blocks of 256 elements; got 96"):
        row_bytes(GGMLType.Q6_K, 96)
    with pytest.raises(ValueError, match="accepted: F32, F16, Q8_0"):
        parse_type("Q4_K_M")
    with pytest.raises(ValueError, match="144 bytes"):
        dequantize(GGMLType.Q4_K, np.zeros((2, 100), np.uint8), 256)
