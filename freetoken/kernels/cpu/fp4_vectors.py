"""MXFP4 blocks as SIMD vectors, for the CPU expert kernel's row dots (`mxfp4_experts.py`).

A block is 16 bytes of E2M1 codes (byte j: value 2j in its low nibble, 2j + 1 in its high one)
and one E8M0 scale. Its 32 values become one 32-lane vector in x's order, multiplied lane by lane
with 32 floats of x, times the block's power of two (exact), and added into a row accumulator that
is summed once per row. So only the order of fp32 additions differs from a scalar loop over the
values (the bound of `mxfp4_experts.py` covers any order).

Codes to values: twice an E2M1 value is a small integer (0, 1, 2, 3, 4, 6, 8, 12 and their
negatives), so each nibble is looked up as a signed byte, the low and high nibbles' bytes are
interleaved into x's order, and the bytes convert to fp32; the 1/2 goes into the block's scale
(2**(e - 128), exact). The lookup is one byte shuffle (SSSE3's pshufb) on x86-64 CPUs that have
it, else the same bytes from integer arithmetic (any CPU LLVM targets); everything else is
target-independent LLVM IR, so LLVM picks the widest vectors the CPU has.

Loads take (array, element offset); callers keep every offset inside the array and pass arrays
of unit stride (no bounds or strides are checked).
"""

from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba.core import cgutils, types
from numba.core.extending import intrinsic

from freetoken.kernels.cpu.block_vectors import Vector, _broadcast, _consts, _load, _splat, _unit_array

F32x32 = Vector("f32", 32)
_I8x16 = ir.VectorType(ir.IntType(8), 16)
TWICE_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # 2 * E2M1 value of code c


def _target_has_pshufb() -> bool:
    """Whether the CPU Numba compiles for has SSSE3's byte shuffle: the features it was told to
    target (NUMBA_CPU_FEATURES), none for a named other CPU (NUMBA_CPU_NAME, e.g. a portable
    cache), else this host's (CPUs other than x86 have no such feature)."""
    from numba.core import config

    if config.CPU_FEATURES is not None:
        return "+ssse3" in config.CPU_FEATURES.split(",")
    if config.CPU_NAME not in (None, "host"):
        return False
    return bool(llvm.get_host_cpu_features().get("ssse3", False))


PSHUFB = _target_has_pshufb()


def _twice_values(builder, codes):
    """<16 x i8> codes (0..15) -> <16 x i8> twice their E2M1 values."""
    if PSHUFB:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I8x16, [_I8x16, _I8x16]),
                                            "llvm.x86.ssse3.pshuf.b.128")
        return builder.call(fn, [ir.Constant(_I8x16, list(TWICE_VALUES)), codes])
    k = builder.and_(codes, _splat(_I8x16, 7))
    below6 = builder.select(builder.icmp_unsigned("<", k, _splat(_I8x16, 6)),
                            builder.shl(builder.sub(k, _splat(_I8x16, 2)), _splat(_I8x16, 1)),
                            builder.shl(builder.sub(k, _splat(_I8x16, 4)), _splat(_I8x16, 2)))
    magnitude = builder.select(builder.icmp_unsigned("<", k, _splat(_I8x16, 4)), k, below6)
    negative = builder.icmp_unsigned("!=", builder.and_(codes, _splat(_I8x16, 8)), _splat(_I8x16, 0))
    return builder.select(negative, builder.neg(magnitude), magnitude)


@intrinsic
def fp4_block(typingctx, r, o):
    """The 32 values of the block whose 16 code bytes start at r[o], in order, each twice its
    E2M1 value, as fp32 lanes."""
    if not (_unit_array(r, types.uint8) and isinstance(o, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        raw = _load(context, builder, sig.args[0], args[0], sig.args[1], args[1], _I8x16)
        low = _twice_values(builder, builder.and_(raw, _splat(_I8x16, 15)))
        high = _twice_values(builder, builder.lshr(raw, _splat(_I8x16, 4)))
        ordered = builder.shuffle_vector(low, high, _consts([lane for j in range(16) for lane in (j, 16 + j)]))
        return builder.sitofp(ordered, F32x32.llvm_type)
    return F32x32(r, o), codegen


@intrinsic
def load_f32x32(typingctx, a, o):
    """a[o:o + 32]."""
    if not (_unit_array(a, types.float32) and isinstance(o, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return _load(context, builder, sig.args[0], args[0], sig.args[1], args[1], F32x32.llvm_type)
    return F32x32(a, o), codegen


@intrinsic
def zeros32(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(F32x32.llvm_type, [0.0] * 32)
    return F32x32(), codegen


@intrinsic
def add_scaled(typingctx, acc, values, x, scale):
    """acc + values * x * scale, lane by lane (scale a float32 for every lane). No fastmath flags:
    every caller's compile rounds alike, so a ring the poller answers equals the direct call bit
    for bit (the product by the power of two is exact, so fusing it would change nothing)."""
    if scale != types.float32:
        return None

    def codegen(context, builder, sig, args):
        acc_, values_, x_, s = args
        scaled = builder.fmul(builder.fmul(values_, x_), _broadcast(builder, F32x32.llvm_type, s))
        return builder.fadd(acc_, scaled)
    return F32x32(F32x32, F32x32, F32x32, scale), codegen


@intrinsic
def sum32(typingctx, v):
    """The sum of an F32x32's lanes in a fixed tree (halves added until one lane is left), for the
    same reason as `add_scaled`."""
    def codegen(context, builder, sig, args):
        v_ = args[0]
        lanes = 32
        while lanes > 1:
            lanes //= 2
            v_ = builder.fadd(builder.shuffle_vector(v_, v_, _consts(range(lanes))),
                              builder.shuffle_vector(v_, v_, _consts(range(lanes, 2 * lanes))))
        return builder.extract_element(v_, ir.Constant(ir.IntType(32), 0))
    return types.float32(F32x32), codegen
