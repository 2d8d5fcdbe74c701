"""The Numba CPU kernel over GGUF-quantized banks against its twin (`reference/quant_moe.py`).

Guarantee checked: |out - twin| <= the activation-code bound (quant_experts.py's docstring,
computed by tests/quant_banks.py from the dequantized banks) + 1e-5 * max|twin| (fp32 rounding:
the kernel applies a sub-block's scales once to its exact integer sum, the twin rounds once per
weight, and the orders of addition differ). A row dot alone is the fp32 dot with the quantized
vector x^ to within that fp32 term.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.kernels.cpu.quant_experts import (
    BF16,
    F16,
    F32,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
    QuantLayout,
    cpu_moe_quant,
    quantize_rows,
    vector_codes,
)
from freetoken.kernels.cpu.vector_dots import dot_row
from freetoken.reference.quant_moe import dequantize_banks, quant_moe_experts
from tests.quant_banks import activation_error_bound, half_steps, make_quant_banks, random_rows

TOL = 1e-5
K_QUANTS = (Q4_K, Q5_K, Q6_K)
ALL_TYPES = (Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32)


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


def assert_within_code_bound(out, ref, x, weights, ids, w13, w2, layout) -> None:
    """|out - ref| <= the activation-code bound + TOL * max|ref|, elementwise."""
    bound = activation_error_bound(x, weights, ids, w13, w2, layout) + TOL * np.abs(ref).max()
    worst = (np.abs(out.astype(np.float64) - ref) - bound).max()
    assert worst <= 0, f"over the activation-code bound by {worst:.3g} (max|twin| {np.abs(ref).max():.3g})"


def codes_of(x: np.ndarray):
    """x [n] quantized as the kernel does: (codes, steps, sums) of one row, and x^ = steps * codes."""
    codes = vector_codes(1, x.shape[0])
    quantize_rows(x[None], codes)
    q, d, s = (c[0] for c in codes)
    return (q, d, s), (q.reshape(-1, 32) * d[:, None].astype(np.float64)).reshape(-1)


def test_quantized_vectors_are_within_half_a_step():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(256) * rng.choice([1e-3, 1.0, 50.0], 256)).astype(np.float32)
    x[64:96] = 0.0  # an all-zero chunk: step 0, codes 0
    (q, d, s), x_hat = codes_of(x)
    assert np.abs(q.astype(np.int64)).max() <= 32767 and not q[64:96].any() and d[2] == 0
    np.testing.assert_array_equal(s, q.reshape(-1, 32).astype(np.int64).sum(axis=1))
    assert (np.abs(x - x_hat) <= half_steps(x) * (1 + 1e-6)).all()


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_one_row_dot_matches_the_dequantized_row(qtype):
    from gguf.quants import dequantize

    rng = np.random.default_rng(qtype)
    n = 512
    row = random_rows(qtype, 1, n, rng)
    x = rng.standard_normal(n).astype(np.float32)
    codes, x_hat = codes_of(x)
    w = dequantize(row, qtype).astype(np.float64).reshape(-1)
    padded = np.concatenate([np.zeros(7, np.uint8), row])  # a row anywhere in its bank
    got = dot_row(padded, 7, qtype, x, *codes)
    seen = x if qtype in (F16, BF16, F32) else x_hat  # plain rows read the fp32 vector
    assert abs(got - w @ seen) <= 1e-5 * np.abs(w).sum() * np.abs(x).max()


@settings(max_examples=25, deadline=None)
@given(
    layers=st.lists(st.tuples(st.sampled_from(K_QUANTS + (Q8_0,)), st.sampled_from(ALL_TYPES)), min_size=1,
                    max_size=3),
    E=st.integers(1, 3),
    I_blocks=st.integers(1, 2),
    N=st.integers(1, 8),
    K=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
    ids_dtype=st.sampled_from([np.int32, np.int64]),
)
def test_kernel_matches_twin(layers, E, I_blocks, N, K, seed, ids_dtype):
    rng = np.random.default_rng(seed)
    H, I = 256, 256 * I_blocks  # whole K-quant blocks; Q8_0 and plain rows take any multiple of 32
    w13, w2, layout = make_quant_banks(layers, E, H, I, rng)
    F = w13.shape[0]
    x = rng.standard_normal((N, H)).astype(np.float32)
    weights = rng.random((N, K)).astype(np.float32)
    ids = rng.integers(-1, F, (N, K)).astype(ids_dtype)  # -1 skipped, repeats likely
    out = np.full_like(x, np.nan)  # the kernel must overwrite every element
    cpu_moe_quant(x, weights, ids, w13, w2, layout, out)
    ref = quant_moe_experts(x, weights, ids, w13, w2, layout.layer_types, E, I)
    if not (ids >= 0).any():
        assert not out.any() and not ref.any()
    else:
        assert_within_code_bound(out, ref, x, weights, ids, w13, w2, layout)


def test_mixed_down_types_pad_the_narrower_layers():
    # A Q4_K_M-like file: Q4_K gate/up everywhere, Q6_K down in one layer, Q4_K in the other.
    rng = np.random.default_rng(3)
    w13, w2, layout = make_quant_banks([(Q4_K, Q6_K), (Q4_K, Q4_K)], 2, 256, 512, rng)
    assert w2.shape[1] == 256 * 2 * 210 and not w2[2:, 256 * 2 * 144 :].any()
    d13, d2 = dequantize_banks(w13, w2, layout.layer_types, 2, 256, 512)
    assert d13.shape == (4, 1024, 256) and d2.shape == (4, 256, 512)


def test_bad_layouts_are_refused_by_name():
    with pytest.raises(ValueError, match="GGUF type 2"):
        QuantLayout(np.array([[2, 8]], np.int32), 1, 256, 256)  # Q4_0: not read here
    with pytest.raises(ValueError, match="not whole blocks"):
        QuantLayout(np.array([[Q4_K, Q8_0]], np.int32), 1, 96, 256)
    with pytest.raises(ValueError, match="int32"):
        QuantLayout(np.array([[Q4_K, Q8_0]], np.int64), 1, 256, 256)
    rng = np.random.default_rng(0)
    w13, w2, layout = make_quant_banks([(Q8_0, Q8_0)], 2, 64, 32, rng)
    x = np.ones((1, 64), np.float32)
    out = np.empty_like(x)
    with pytest.raises(ValueError, match="expert id out of range"):
        cpu_moe_quant(x, np.ones((1, 1), np.float32), np.array([[2]], np.int32), w13, w2, layout, out)
    with pytest.raises(ValueError, match="do not fit the banks"):
        narrow = np.ascontiguousarray(w13[:, :-1])
        cpu_moe_quant(x, np.ones((1, 1), np.float32), np.array([[0]], np.int32), narrow, w2, layout, out)


@pytest.mark.parametrize("n", [32, 96, 160, 416])
def test_q8_0_rows_of_any_whole_block_count(n):
    """Q8_0 rows are read four blocks a loop, then one at a time: rows that end in each way."""
    from gguf.quants import dequantize

    rng = np.random.default_rng(n)
    row = random_rows(Q8_0, 1, n, rng)
    x = rng.standard_normal(n).astype(np.float32)
    codes, x_hat = codes_of(x)
    ref = float(dequantize(row, Q8_0).astype(np.float64).reshape(-1) @ x_hat)
    got = dot_row(row, 0, Q8_0, x, *codes)
    assert abs(got - ref) <= 1e-5 * np.abs(dequantize(row, Q8_0)).sum() * np.abs(x).max()


def quantized_twin(x, weights, ids, w13, w2, layout) -> np.ndarray:
    """The fp32 experts evaluated where the kernel evaluates them: at x^ and at act^ (act
    quantized from the twin's own fp32 act), from the dequantized banks, in float64."""
    from freetoken.reference.quant_moe import dequantize_banks

    E, I = layout.experts_per_layer, layout.intermediate
    d13, d2 = dequantize_banks(w13, w2, layout.layer_types, E, layout.hidden, I)
    out = np.zeros(x.shape)
    for n, k in zip(*np.nonzero(ids >= 0), strict=True):
        f = int(ids[n, k])
        x_hat = codes_of(x[n])[1]
        g, u = d13[f, :I] @ x_hat, d13[f, I:] @ x_hat
        act = (g / (1.0 + np.exp(-g)) * u).astype(np.float32)
        out[n] += float(weights[n, k]) * (d2[f].astype(np.float64) @ codes_of(act)[1])
    return out


@pytest.mark.parametrize("types", [(Q4_K, Q6_K), (Q4_K, Q4_K), (Q5_K, Q8_0), (Q8_0, Q6_K)])
def test_kernel_is_the_expert_at_the_quantized_vectors(types):
    """Much tighter than the worst-case bound: against a twin fed x^ and act^ the kernel differs
    by fp32 rounding plus, rarely, an act code that a rounding edge sends to its neighbour (one
    step, 1/32767 of a chunk's largest value, of one element): within 1e-5 of the output here,
    several times less than the code error itself (against the fp32 twin)."""
    rng = np.random.default_rng(types[0] * 100 + types[1])
    E, H, I, N, K = 2, 256, 512, 3, 2
    w13, w2, layout = make_quant_banks([types], E, H, I, rng)
    x = rng.standard_normal((N, H)).astype(np.float32)
    weights = rng.random((N, K)).astype(np.float32)
    ids = rng.integers(0, E, (N, K)).astype(np.int32)
    out = np.empty_like(x)
    cpu_moe_quant(x, weights, ids, w13, w2, layout, out)
    assert rel_err(out, quantized_twin(x, weights, ids, w13, w2, layout)) <= TOL
