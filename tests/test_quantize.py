"""The quantizer: round trips within its stated bound, read back alike by us and by `gguf`."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.quant.ggml_blocks import BLOCK_SIZES, GGMLType, dequantize, row_bytes
from freetoken.quant.quantize import error_bound, quantize

gguf = pytest.importorskip("gguf")


@st.composite
def _rows(draw, qtype: GGMLType) -> np.ndarray:
    block = max(32, BLOCK_SIZES[qtype][0])
    rows = draw(st.integers(1, 3))
    blocks = draw(st.integers(1, 2))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([1e-5, 1e-2, 0.3, 7.0]))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, blocks * block)).astype(np.float32) * np.float32(scale)
    shape = draw(st.sampled_from(["normal", "positive", "negative", "sparse"]))
    if shape == "positive":
        x = np.abs(x)
    elif shape == "negative":
        x = -np.abs(x)
    elif shape == "sparse":
        x[rng.random(x.shape) < 0.9] = 0.0
    return x


@pytest.mark.parametrize("qtype", list(GGMLType), ids=lambda t: t.name)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_round_trip_within_bound_and_dequantized_alike(qtype, data):
    x = data.draw(_rows(qtype))
    q = quantize(qtype, x, workers=2)
    assert q.dtype == np.uint8 and q.shape == (*x.shape[:-1], row_bytes(qtype, x.shape[-1]))
    ref = np.asarray(gguf.quants.dequantize(q, gguf.GGMLQuantizationType(int(qtype))), dtype=np.float32)
    assert np.all(np.abs(ref - x) <= error_bound(qtype, x))
    ours = dequantize(qtype, q, x.shape[-1])
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


@settings(max_examples=25, deadline=None)
@given(x=_rows(GGMLType.Q8_0))
def test_q8_0_and_bf16_equal_gguf_quantizer(x):
    for qtype in (GGMLType.Q8_0, GGMLType.BF16):
        ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType(int(qtype)))
        assert np.array_equal(quantize(qtype, x), ref)


def test_parallel_chunks_equal_one_pass():
    x = np.random.default_rng(0).standard_normal((40, 8192)).astype(np.float32)
    for qtype in (GGMLType.Q4_K, GGMLType.Q6_K):
        assert np.array_equal(quantize(qtype, x, workers=4), quantize(qtype, x, workers=1))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="non-finite"):
        quantize(GGMLType.Q8_0, np.full((1, 32), np.inf, np.float32))
    with pytest.raises(ValueError, match="float32"):
        quantize(GGMLType.Q8_0, np.zeros((1, 32), np.float64))
    with pytest.raises(ValueError, match="Q4_K row holds whole blocks of 256"):
        quantize(GGMLType.Q4_K, np.zeros((1, 64), np.float32))
    with pytest.raises(ValueError, match="f16"):
        quantize(GGMLType.Q4_K, np.full((1, 256), 3e38, np.float32))
