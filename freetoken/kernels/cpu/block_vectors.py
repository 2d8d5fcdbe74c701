"""SIMD vectors as Numba values, for the GGUF block dots (`vector_dots.py`).

LLVM's loop vectoriser turns the block dots' nibble unpacking, 16-bit multiply-adds and
per-sub-block sums into vector code only partway (the scalar loops of `quant_dots.py` ran at a
third of the speed of these, rows in cache).
Here each step is written as one LLVM vector operation instead: a Numba type per vector shape
(`Vector`, held in registers as an LLVM `<lanes x elem>`) and intrinsics that load, unpack, widen,
multiply-add and reduce them. Only target-independent LLVM IR is emitted (no x86 intrinsics), so
the same code compiles for whatever CPU Numba targets: LLVM picks the widest instructions that CPU
has (pmaddwd from SSE2 to AVX-512) and splits the 512-bit shapes where registers are narrower.

Loads take (array, element offset) and read `lanes` consecutive elements from there: callers keep
every offset inside the array and pass arrays of unit stride (no bounds or strides are checked;
`vector_dots.dot_row` falls back to the scalar dots for other rows). Integer results are exact
(callers keep sums inside int32, as `quant_dots.py` does); float operations carry the kernels'
fastmath flags (`experts.FASTMATH`), so sums may be reassociated.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.core.datamodel import models
from numba.core.extending import intrinsic, register_model

from freetoken.kernels.cpu.experts import FASTMATH

_ELEMENTS = {"u8": ir.IntType(8), "i16": ir.IntType(16), "i32": ir.IntType(32), "f32": ir.FloatType()}
_I32 = ir.IntType(32)
_FLAGS = tuple(sorted(FASTMATH))


class Vector(types.Type):
    """A SIMD vector of `lanes` elements of `kind` (u8, i16, i32 or f32)."""

    def __init__(self, kind: str, lanes: int):
        self.kind, self.lanes = kind, lanes
        super().__init__(name=f"{kind}x{lanes}")

    @property
    def llvm_type(self) -> ir.VectorType:
        return ir.VectorType(_ELEMENTS[self.kind], self.lanes)


@register_model(Vector)
class _VectorModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, fe_type.llvm_type)


U8x32, I16x32, I32x16, I32x8, F32x8 = Vector("u8", 32), Vector("i16", 32), Vector("i32", 16), Vector("i32", 8), \
    Vector("f32", 8)


def _consts(values, bits: int = 32) -> ir.Constant:
    return ir.Constant(ir.VectorType(ir.IntType(bits), len(values)), list(values))


def _splat(vec_type: ir.VectorType, value) -> ir.Constant:
    return ir.Constant(vec_type, [value] * vec_type.count)


def _shuffle(builder, a, b, lanes):
    return builder.shuffle_vector(a, b, _consts(lanes))


def _broadcast(builder, vec_type: ir.VectorType, x):
    """The run-time scalar x (of vec_type's element type) in every lane."""
    one = builder.insert_element(ir.Constant(vec_type, None), x, _I32(0))
    return builder.shuffle_vector(one, ir.Constant(vec_type, None), _consts([0] * vec_type.count))


def _integer(context, builder, sig, args, k: int, bits: int):
    """Integer argument k truncated to `bits` bits."""
    return builder.trunc(context.cast(builder, args[k], sig.args[k], types.int64), ir.IntType(bits))


def _load(context, builder, arr_type, arr, offset_type, offset, vec_type: ir.VectorType):
    """vec_type's lanes from arr[offset:], unaligned."""
    data = context.make_array(arr_type)(context, builder, arr).data
    ptr = builder.gep(data, [context.cast(builder, offset, offset_type, types.intp)])
    return builder.load(builder.bitcast(ptr, vec_type.as_pointer()), align=1)


def _unit_array(a, dtype) -> bool:
    return isinstance(a, types.Array) and a.ndim == 1 and a.dtype == dtype and a.layout in "CA"


def _loader(dtype, result: Vector):
    """An intrinsic (array of dtype, offset) -> result, reading result.lanes elements of dtype from
    the offset (converted to floats, as signed integers, where result is F32x8)."""
    def load(typingctx, a, o):
        if not (_unit_array(a, dtype) and isinstance(o, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            element = context.get_value_type(dtype)
            v = _load(context, builder, sig.args[0], args[0], sig.args[1], args[1],
                      ir.VectorType(element, result.lanes))
            return builder.sitofp(v, result.llvm_type) if result is F32x8 and dtype != types.float32 else v
        return result(a, o), codegen
    return intrinsic(load)


load_u8x32 = _loader(types.uint8, U8x32)  # 32 bytes
load_i16x32 = _loader(types.int16, I16x32)  # 32 int16 codes
load_f32x8 = _loader(types.float32, F32x8)  # 8 floats
load_i32x8_as_f32 = _loader(types.int32, F32x8)  # 8 int32, as floats
load_i8x8_as_f32 = _loader(types.uint8, F32x8)  # 8 bytes read as int8, as floats


@intrinsic
def load_f32x4_twice(typingctx, a, o):
    """[a[o], a[o], a[o+1], a[o+1], ..., a[o+3], a[o+3]]: 4 floats, each for two lanes."""
    if not (_unit_array(a, types.float32) and isinstance(o, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v = _load(context, builder, sig.args[0], args[0], sig.args[1], args[1], ir.VectorType(ir.FloatType(), 4))
        return _shuffle(builder, v, v, [0, 0, 1, 1, 2, 2, 3, 3])
    return F32x8(a, o), codegen


@intrinsic
def low_nibbles(typingctx, v):
    """v & 15, bytewise."""
    def codegen(context, builder, sig, args):
        return builder.and_(args[0], _splat(U8x32.llvm_type, 15))
    return U8x32(U8x32), codegen


@intrinsic
def high_nibbles(typingctx, v):
    """v >> 4, bytewise."""
    def codegen(context, builder, sig, args):
        return builder.lshr(args[0], _splat(U8x32.llvm_type, 4))
    return U8x32(U8x32), codegen


@intrinsic
def with_high_bits(typingctx, low, h, shift, mask):
    """low | ((h >> shift) & mask) << 4, bytewise: a 5- or 6-bit code from its nibble and the bits
    of h that extend it (shift, mask integers)."""
    if not (isinstance(shift, types.Integer) and isinstance(mask, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        vt = U8x32.llvm_type
        shift, mask = (_broadcast(builder, vt, _integer(context, builder, sig, args, k, 8)) for k in (2, 3))
        bits = builder.and_(builder.lshr(args[1], shift), mask)
        return builder.or_(args[0], builder.shl(bits, _splat(vt, 4)))
    return U8x32(U8x32, U8x32, shift, mask), codegen


@intrinsic
def widen(typingctx, v, signed):
    """v's bytes as int16 codes: as int8 (sign-extended) when `signed` is a true literal, else
    as uint8."""
    if not isinstance(signed, types.BooleanLiteral):
        return None

    def codegen(context, builder, sig, args):
        extend = builder.sext if signed.literal_value else builder.zext
        return extend(args[0], I16x32.llvm_type)
    return I16x32(U8x32, signed), codegen


@intrinsic
def minus(typingctx, v, c):
    """v - c for int16 codes (c an integer)."""
    if not isinstance(c, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.sub(args[0], _broadcast(builder, I16x32.llvm_type, _integer(context, builder, sig, args, 1, 16)))
    return I16x32(I16x32, c), codegen


@intrinsic
def madd(typingctx, a, b):
    """[a[2k] * b[2k] + a[2k+1] * b[2k+1] for k < 16] in int32. Written as LLVM's x86 backend
    recognises pmaddwd (vpdpwssd with AVX-512 VNNI): widen, multiply, then add even and odd lanes.
    Splitting a and b into even and odd lanes first let LLVM merge an int8 -> int16 widening into
    an int8 -> int32 one and multiply in 32 bits (vpmulld): Q8_0 rows ran at two thirds the speed."""
    def codegen(context, builder, sig, args):
        wide = ir.VectorType(_I32, 32)
        products = builder.mul(*(builder.sext(v, wide) for v in args))
        return builder.add(_shuffle(builder, products, products, range(0, 32, 2)),
                           _shuffle(builder, products, products, range(1, 32, 2)))
    return I32x16(I16x32, I16x32), codegen


def _half(which: int):
    def half(typingctx, v):
        def codegen(context, builder, sig, args):
            return _shuffle(builder, args[0], args[0], range(8 * which, 8 * which + 8))
        return I32x8(I32x16), codegen
    return intrinsic(half)


low_half, high_half = _half(0), _half(1)  # lanes 0..7 and 8..15 of an I32x16


@intrinsic
def fold(typingctx, v):
    """The two halves of v added: 8 lanes whose sum is v's."""
    def codegen(context, builder, sig, args):
        v = args[0]
        return builder.add(_shuffle(builder, v, v, range(8)), _shuffle(builder, v, v, range(8, 16)))
    return I32x8(I32x16), codegen


@intrinsic
def sums8(typingctx, v0, v1, v2, v3, v4, v5, v6, v7):
    """[sum of v_j's lanes for j < 8]: three rounds of adding neighbouring lanes of two vectors
    (v_j's lanes stay in order, so lane j of the last round is v_j's total)."""
    def codegen(context, builder, sig, args):
        def pair(x, y):
            return builder.add(_shuffle(builder, x, y, range(0, 16, 2)), _shuffle(builder, x, y, range(1, 16, 2)))
        level = list(args)
        while len(level) > 1:
            level = [pair(level[k], level[k + 1]) for k in range(0, len(level), 2)]
        return level[0]
    return I32x8(*([I32x8] * 8)), codegen


@intrinsic
def total(typingctx, v):
    """The sum of an I32x8's lanes, int32."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [I32x8.llvm_type]),
                                            "llvm.vector.reduce.add.v8i32")
        return builder.call(fn, [args[0]])
    return types.int32(I32x8), codegen


@intrinsic
def to_f32(typingctx, v):
    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], F32x8.llvm_type)
    return F32x8(I32x8), codegen


@intrinsic
def splat(typingctx, x):
    """x (a float32) in all 8 lanes."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return _broadcast(builder, F32x8.llvm_type, args[0])
    return F32x8(x), codegen


def _float_op(name: str):
    def op(typingctx, a, b):
        def codegen(context, builder, sig, args):
            return getattr(builder, name)(args[0], args[1], flags=_FLAGS)
        return F32x8(F32x8, F32x8), codegen
    return intrinsic(op)


fadd, fsub, fmul = _float_op("fadd"), _float_op("fsub"), _float_op("fmul")


@intrinsic
def fsum(typingctx, v):
    """The sum of an F32x8's lanes, float32 (in any order)."""
    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, F32x8.llvm_type]),
                                            "llvm.vector.reduce.fadd.v8f32")
        return builder.call(fn, [ir.Constant(f32, -0.0), args[0]], fastmath=_FLAGS)
    return types.float32(F32x8), codegen


def _k4_bytes(context, builder, sig, args):
    """(A, B) = the 6-bit scale bytes s[0:8] and s[4:12] from r[o:], widened to int32 lanes."""
    def eight(at):
        o = builder.add(context.cast(builder, args[1], sig.args[1], types.intp), ir.Constant(ir.IntType(64), at))
        v = _load(context, builder, sig.args[0], args[0], types.intp, o, ir.VectorType(ir.IntType(8), 8))
        return builder.zext(v, I32x8.llvm_type)
    return eight(0), eight(4)


def _k4_unpacker(mins: bool):
    """Q4_K/Q5_K's 8 sub-block scales (or mins) as floats from the 12 bytes at r[o:]: sub-block j < 4
    takes 6 bits of one byte, j >= 4 a nibble and two bits from two others (quant_dots._k4_scale_min)."""
    def unpack(typingctx, r, o):
        if not (_unit_array(r, types.uint8) and isinstance(o, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            a, b = _k4_bytes(context, builder, sig, args)
            def c(k):
                return _splat(I32x8.llvm_type, k)
            if mins:  # j < 4: s[j + 4] & 63; j >= 4: (s[j + 4] >> 4) | ((s[j] >> 6) << 4)
                low, high = builder.and_(b, c(63)), builder.or_(builder.lshr(b, c(4)),
                                                              builder.shl(builder.lshr(a, c(6)), c(4)))
            else:  # j < 4: s[j] & 63; j >= 4: (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4)
                before = _shuffle(builder, a, a, [0, 1, 2, 3, 0, 1, 2, 3])
                low, high = builder.and_(a, c(63)), builder.or_(builder.and_(b, c(15)),
                                                              builder.shl(builder.lshr(before, c(6)), c(4)))
            v = _shuffle(builder, low, high, [0, 1, 2, 3, 12, 13, 14, 15])
            return builder.sitofp(v, F32x8.llvm_type)
        return F32x8(r, o), codegen
    return intrinsic(unpack)


k4_scales, k4_mins = _k4_unpacker(False), _k4_unpacker(True)


def _f16_lanes(builder, h):
    """quant_dots._f16's bit trick lane by lane: the fp32 values of the f16 bits in h (an int32
    vector), subnormals, inf and NaN too."""
    vt = h.type
    f32 = ir.VectorType(ir.FloatType(), vt.count)
    def c(k):
        return _splat(vt, k)
    em = builder.and_(h, c(0x7FFF))
    # Shifted into fp32's place, the exponent is 112 short: 2**112 fixes normal and subnormal
    # values alike; inf and NaN keep an all-ones exponent.
    mag = builder.fmul(builder.bitcast(builder.shl(em, c(13)), f32), _splat(f32, 5.192296858534828e33))
    special = builder.or_(c(0x7F800000), builder.shl(builder.and_(em, c(0x3FF)), c(13)))
    mag = builder.select(builder.icmp_unsigned(">=", em, c(0x7C00)), builder.bitcast(special, f32), mag)
    sign = builder.shl(builder.and_(h, c(0x8000)), c(16))
    return builder.bitcast(builder.or_(builder.bitcast(mag, vt), sign), f32)


def _f16_gather(context, builder, sig, args, lanes: int):
    """The little-endian f16 values at bytes r[o + stride * k:], k < lanes, as an fp32 vector
    (args: r, o, stride; no stride for one lane)."""
    i16, i64 = ir.IntType(16), ir.IntType(64)
    o = context.cast(builder, args[1], sig.args[1], types.intp)
    step = context.cast(builder, args[2], sig.args[2], types.intp) if lanes > 1 else None
    h = ir.Constant(ir.VectorType(i16, lanes), None)
    for k in range(lanes):
        at = builder.add(o, builder.mul(step, ir.Constant(i64, k))) if k else o
        value = _load(context, builder, sig.args[0], args[0], types.intp, at, ir.VectorType(i16, 1))
        h = builder.insert_element(h, builder.extract_element(value, _I32(0)), _I32(k))
    return _f16_lanes(builder, builder.zext(h, ir.VectorType(_I32, lanes)))


@intrinsic
def f16x8(typingctx, r, o, stride):
    """The 8 f16 values at bytes r[o + stride * k:], k < 8, as floats (Q8_0's block scales)."""
    if not (_unit_array(r, types.uint8) and isinstance(o, types.Integer) and isinstance(stride, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return _f16_gather(context, builder, sig, args, 8)
    return F32x8(r, o, stride), codegen


@intrinsic
def f16_at(typingctx, r, o):
    """The f16 value at bytes r[o:o + 2], float32."""
    if not (_unit_array(r, types.uint8) and isinstance(o, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.extract_element(_f16_gather(context, builder, sig, args, 1), _I32(0))
    return types.float32(r, o), codegen
