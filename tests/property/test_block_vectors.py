"""The SIMD helpers of kernels/cpu/block_vectors.py against numpy, and the vector row dots of
kernels/cpu/vector_dots.py against their scalar twins (kernels/cpu/quant_dots.py).

Guarantees checked: integer helpers (loads, nibbles, high bits, widening, multiply-add, folds,
sums) are exact; f16 and K-quant scale unpacking equal the scalar twins bit for bit (NaN as NaN);
float lane operations equal numpy's fp32 (a lane sum to within its reassociation); a vector row
dot equals the scalar twin's to 1e-5 * sum|w * x^| (the same exact integer sums, the fp32 scale
products taken in another order).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit, types
from numba.core.extending import intrinsic

from freetoken.kernels.cpu import block_vectors as bv
from freetoken.kernels.cpu import quant_dots, vector_dots
from freetoken.kernels.cpu.quant_experts import quantize_rows, vector_codes
from tests.quant_banks import random_rows


@intrinsic
def store(typingctx, v, out):
    """out[:lanes] = v's lanes (test only: the kernels never leave vectors in memory)."""
    if not isinstance(v, bv.Vector):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[1])(context, builder, args[1]).data
        builder.store(args[0], builder.bitcast(data, sig.args[0].llvm_type.as_pointer()), align=1)
        return context.get_dummy_value()
    return types.none(v, out), codegen



@njit
def loads(b, w, f, i, o, out_u8, out_i16, out_f32, out_i32f, out_i8f, out_twice):
    store(bv.load_u8x32(b, o), out_u8)
    store(bv.load_i16x32(w, o), out_i16)
    store(bv.load_f32x8(f, o), out_f32)
    store(bv.load_i32x8_as_f32(i, o), out_i32f)
    store(bv.load_i8x8_as_f32(b, o), out_i8f)
    store(bv.load_f32x4_twice(f, o), out_twice)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), o=st.integers(0, 40))
def test_loads_read_consecutive_elements(seed, o):
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, 80, dtype=np.uint8)
    w = rng.integers(-32768, 32768, 80, dtype=np.int16)
    f = rng.standard_normal(80).astype(np.float32)
    i = rng.integers(-(2**24), 2**24, 80, dtype=np.int32)
    outs = [np.zeros(32, np.uint8), np.zeros(32, np.int16)] + [np.zeros(8, np.float32) for _ in range(4)]
    loads(b, w, f, i, o, *outs)
    np.testing.assert_array_equal(outs[0], b[o:o + 32])
    np.testing.assert_array_equal(outs[1], w[o:o + 32])
    np.testing.assert_array_equal(outs[2], f[o:o + 8])
    np.testing.assert_array_equal(outs[3], i[o:o + 8].astype(np.float32))
    np.testing.assert_array_equal(outs[4], b[o:o + 8].view(np.int8).astype(np.float32))
    np.testing.assert_array_equal(outs[5], np.repeat(f[o:o + 4], 2))


@njit
def byte_ops(b, h, shift, mask, c, out_lo, out_hi, out_bits, out_u16, out_s16, out_minus):
    v, hv = bv.load_u8x32(b, 0), bv.load_u8x32(h, 0)
    store(bv.low_nibbles(v), out_lo)
    store(bv.high_nibbles(v), out_hi)
    store(bv.with_high_bits(bv.low_nibbles(v), hv, shift, mask), out_bits)
    store(bv.widen(v, False), out_u16)
    store(bv.widen(v, True), out_s16)
    store(bv.minus(bv.widen(v, False), c), out_minus)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shift=st.integers(0, 7), mask=st.sampled_from([1, 3]),
       c=st.integers(-128, 128))
def test_byte_unpacking_matches_numpy(seed, shift, mask, c):
    rng = np.random.default_rng(seed)
    b, h = rng.integers(0, 256, 32, dtype=np.uint8), rng.integers(0, 256, 32, dtype=np.uint8)
    outs = [np.zeros(32, np.uint8) for _ in range(3)] + [np.zeros(32, np.int16) for _ in range(3)]
    byte_ops(b, h, shift, mask, c, *outs)
    np.testing.assert_array_equal(outs[0], b & 15)
    np.testing.assert_array_equal(outs[1], b >> 4)
    np.testing.assert_array_equal(outs[2], (b & 15) | (((h >> shift) & mask) << 4))
    np.testing.assert_array_equal(outs[3], b.astype(np.int16))
    np.testing.assert_array_equal(outs[4], b.view(np.int8).astype(np.int16))
    np.testing.assert_array_equal(outs[5], b.astype(np.int16) - c)


@njit(inline="always")
def _chunk(vs, j, b):
    return bv.fold(bv.madd(bv.load_i16x32(vs, 32 * j), bv.load_i16x32(b, 0)))


@njit
def integer_ops(a, b, vs, out_madd, out_fold, out_lo, out_hi, out_sums, out_float):
    m = bv.madd(bv.load_i16x32(a, 0), bv.load_i16x32(b, 0))
    store(m, out_madd)
    store(bv.fold(m), out_fold)
    store(bv.low_half(m), out_lo)
    store(bv.high_half(m), out_hi)
    s = bv.sums8(_chunk(vs, 0, b), _chunk(vs, 1, b), _chunk(vs, 2, b), _chunk(vs, 3, b), _chunk(vs, 4, b),
                 _chunk(vs, 5, b), _chunk(vs, 6, b), _chunk(vs, 7, b))
    store(s, out_sums)
    store(bv.to_f32(s), out_float)
    return bv.total(s)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_multiply_adds_and_sums_are_exact(seed):
    rng = np.random.default_rng(seed)
    a = rng.integers(-32767, 32768, 32, dtype=np.int16)  # the activation codes' range
    b = rng.integers(-128, 256, 32, dtype=np.int16)  # widened weight codes: int8, or uint8
    vs = rng.integers(-128, 256, 256, dtype=np.int16)
    out = [np.zeros(16, np.int32)] + [np.zeros(8, np.int32) for _ in range(4)] + [np.zeros(8, np.float32)]
    got_total = integer_ops(b, a, vs, *out)
    pairs = (a.astype(np.int64) * b).reshape(16, 2).sum(axis=1)
    np.testing.assert_array_equal(out[0], pairs)
    np.testing.assert_array_equal(out[1], pairs[:8] + pairs[8:])
    np.testing.assert_array_equal(out[2], pairs[:8])
    np.testing.assert_array_equal(out[3], pairs[8:])
    sums = (vs.reshape(8, 32).astype(np.int64) * a).sum(axis=1)
    np.testing.assert_array_equal(out[4], sums)
    np.testing.assert_array_equal(out[5], sums.astype(np.float32))
    assert got_total == sums.sum()


@njit
def float_ops(f, g, x, out_add, out_sub, out_mul, out_splat):
    a, b = bv.load_f32x8(f, 0), bv.load_f32x8(g, 0)
    store(bv.fadd(a, b), out_add)
    store(bv.fsub(a, b), out_sub)
    store(bv.fmul(a, b), out_mul)
    store(bv.splat(x), out_splat)
    return bv.fsum(a)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_float_lanes_match_numpy(seed):
    rng = np.random.default_rng(seed)
    f, g = (rng.standard_normal(8).astype(np.float32) for _ in range(2))
    x = np.float32(rng.standard_normal())
    out = [np.zeros(8, np.float32) for _ in range(4)]
    got_sum = float_ops(f, g, x, *out)
    np.testing.assert_array_equal(out[0], f + g)
    np.testing.assert_array_equal(out[1], f - g)
    np.testing.assert_array_equal(out[2], f * g)
    np.testing.assert_array_equal(out[3], np.full(8, x))
    assert abs(got_sum - f.astype(np.float64).sum()) <= 8 * np.finfo(np.float32).eps * np.abs(f).sum()


@njit
def unpack(r, o, stride, out_sc, out_m, out_f16, out_first):
    store(bv.k4_scales(r, o), out_sc)
    store(bv.k4_mins(r, o), out_m)
    store(bv.f16x8(r, o, stride), out_f16)
    out_first[0] = bv.f16_at(r, o)  # stored, not returned: Python's float would quieten a signalling NaN


@njit
def scalar_unpack(r, o, stride, out_sc, out_m, out_f16):
    for j in range(8):
        out_sc[j], out_m[j] = quant_dots._k4_scale_min(r, o, j)
        out_f16[j] = quant_dots._f16(r[o + stride * j], r[o + stride * j + 1])


SPECIAL_F16 = [0x0000, 0x8000, 0x0001, 0x83FF, 0x0400, 0x3C00, 0x7BFF, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), o=st.integers(0, 8), stride=st.sampled_from([2, 34]),
       special=st.booleans())
def test_scale_and_f16_unpacking_equal_the_scalar_twins(seed, o, stride, special):
    rng = np.random.default_rng(seed)
    r = rng.integers(0, 256, 8 + 8 * 34 + 2, dtype=np.uint8)
    if special:  # subnormals, infinities, NaNs, signed zeros as the f16 values
        for j, bits in enumerate(rng.choice(SPECIAL_F16, 8)):
            r[o + stride * j: o + stride * j + 2] = np.array([bits], np.uint16).view(np.uint8)
    got = [np.zeros(8, np.float32) for _ in range(3)]
    want = [np.zeros(8, np.float32) for _ in range(3)]
    first = np.zeros(1, np.float32)
    unpack(r, o, stride, *got, first)
    scalar_unpack(r, o, stride, *want)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2].view(np.uint32), want[2].view(np.uint32))  # NaN payloads too
    halfs = np.array([r[o + stride * j: o + stride * j + 2].view(np.float16)[0] for j in range(8)])
    np.testing.assert_array_equal(got[2], halfs.astype(np.float32))  # NaN compares equal to NaN here
    assert first.view(np.uint32)[0] == want[2][:1].view(np.uint32)[0]


ROW_TYPES = (quant_dots.Q8_0, quant_dots.Q4_K, quant_dots.Q5_K, quant_dots.Q6_K, quant_dots.F16, quant_dots.BF16,
             quant_dots.F32)


@pytest.mark.parametrize("qtype", ROW_TYPES)
@pytest.mark.parametrize("n", [256, 768, 2048, 2336])
def test_vector_rows_match_the_scalar_dots(qtype, n):
    if qtype in (quant_dots.Q4_K, quant_dots.Q5_K, quant_dots.Q6_K) and n % 256:
        n -= n % 256  # K-quant rows are whole 256-value blocks; Q8_0 keeps its tail blocks
    rng = np.random.default_rng(n + qtype)
    m = 5
    rows = random_rows(qtype, m, n, rng)
    rb = rows.size // m
    bank = np.concatenate([np.zeros(3, np.uint8), rows.reshape(-1)])  # rows at an odd offset
    x = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 30.0], n)).astype(np.float32)
    codes = vector_codes(1, n)
    quantize_rows(x[None], codes)
    q, d, s = (c[0] for c in codes)
    got = np.zeros(m, np.float32)
    vector_dots.dot_rows(bank, 3, rb, qtype, x, q, d, s, got)
    want = np.array([quant_dots.dot_row(bank, 3 + k * rb, qtype, x, q, d, s) for k in range(m)])
    from gguf.quants import dequantize

    w = dequantize(rows.reshape(m, rb), qtype).astype(np.float64).reshape(m, n)
    x_hat = x if qtype in (quant_dots.F16, quant_dots.BF16, quant_dots.F32) else \
        (q.reshape(-1, 32) * d[:, None].astype(np.float64)).reshape(-1)
    scale = np.abs(w * x_hat).sum(axis=1)
    assert (np.abs(got - want) <= 1e-5 * scale).all()
    assert vector_dots.dot_row(bank, 3 + rb, qtype, x, q, d, s) == got[1]
    strided = np.repeat(bank, 2)[::2]  # the same bytes at stride 2: the scalar dots (fallback)
    fallback = np.zeros(m, np.float32)
    vector_dots.dot_rows(strided, 3, rb, qtype, x, q, d, s, fallback)
    assert (np.abs(fallback - want) <= 1e-5 * scale).all()  # fastmath: compiled apart, added apart
