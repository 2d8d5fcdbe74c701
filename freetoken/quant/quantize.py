"""A vectorised numpy quantizer into the GGML block formats, with its error bound.

`quantize(qtype, x)` turns float32 rows [..., n] into uint8 blocks [..., row_bytes(qtype, n)]
that `ggml_blocks.dequantize` (and the `gguf` package, and llama.cpp) read back. Rows are
cut into chunks of whole blocks processed by a thread pool: numpy releases the GIL inside
its array operations, so a whole tensor quantizes on every core without a loop over blocks.

How each format chooses its numbers, and the bound it guarantees for every element, where
A is the largest |x| of the element's block (Q8_0: 32 elements; K-quants: 256):

- Q8_0: d = A / 127, q = round-half-away(x * (1/d)), d stored as the nearest f16; the same
  numbers as ggml's reference quantizer. |x - x̂| <= d/2 + 127 * (d's f16 rounding error).
- Q4_K / Q5_K (L = 15 / 31 levels): each 32-element sub-block gets an offset m covering its
  minimum (min(x, 0)) and a step covering its range from there, so no element is clipped;
  the super-block's dmin and d are the largest m / 63 and step / 63 rounded UP to f16, and
  each sub-block's 6-bit m and scale are rounded up against them. Then
  |x - x̂| <= step / 2 <= ((2A + dmin) / L + d) / 2, about A/14.6 (Q4_K) or A/30 (Q5_K).
- Q6_K: each 16-element sub-block's step covers its largest |x| in 31 steps; d is the
  largest step / 127 rounded up to f16, the int8 scales are rounded up against it:
  |x - x̂| <= step / 2 <= (A/31 + d) / 2, about A/61.
- MXFP4 (32 elements): quant/mxfp4.py's rule (the exponent that brings A within the codes'
  6, the nearest code), stored in GGML's order; |x - x̂| <= 2^e, half the widest gap between
  codes (4 to 6), e = ceil(log2(A / 6)).
- F16 / BF16: round to nearest even; |x - x̂| <= |x| * 2^-11 (f16; at least 2^-25 for
  subnormals) or |x| * 2^-8 (bf16). F32 is exact.

`error_bound(qtype, x)` gives these bounds element by element (with a little float32
slack), so tests and callers can check a round trip. Non-finite input, and input whose
scales do not fit an f16, get a ValueError.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from freetoken.quant.ggml_blocks import BLOCK_SIZES, GGMLType, row_bytes

# Elements per chunk handed to a worker: big enough that numpy's per-call cost vanishes,
# small enough that a chunk's float32 temporaries stay in a core's cache hierarchy.
_CHUNK_ELEMS = 1 << 18

_F16_MAX = float(np.finfo(np.float16).max)
_F16_REL = 2.0**-10  # one f16 ulp, relative, for normal values
_F16_TINY = 2.0**-24  # one f16 ulp among subnormals


def _f16_round_up(value: np.ndarray, what: str) -> np.ndarray:
    """The smallest f16 >= `value` (float32, >= 0), back as float32. Rounding the super-block
    scales up keeps every sub-block's range inside what its 6-bit scale can express."""
    if np.any(value > _F16_MAX):
        raise ValueError(f"{what} scale {float(value.max()):g} does not fit an f16; the values are too large")
    half = value.astype(np.float16)
    low = half.astype(np.float32) < value
    half[low] = np.nextafter(half[low], np.float16(np.inf))
    return half


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """Round to nearest, ties away from zero (ggml's roundf), exact for every float32."""
    whole = np.trunc(v)
    tie = np.abs(v - whole) == 0.5
    return np.where(tie, whole + np.sign(v), np.rint(v))


def _store_f16(out: np.ndarray, at: int, half: np.ndarray) -> None:
    out[:, at : at + 2] = half.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _ceil_div(num: np.ndarray, den: np.ndarray, top: int) -> np.ndarray:
    """ceil(num / den) clipped to [0, top]; 0 where den is 0 (an all-zero block)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(den > 0, num / den, 0.0)
    return np.clip(np.ceil(ratio), 0, top)


def _quant_q8_0(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(-1, 32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    if np.any(d > _F16_MAX):
        raise ValueError("Q8_0 scale does not fit an f16; the values are too large")
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    out = np.empty((blocks.shape[0], 34), dtype=np.uint8)
    _store_f16(out, 0, d)
    out[:, 2:] = _round_half_away(blocks * inv).astype(np.int8).view(np.uint8)
    return out


def pack_k_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """(scales, mins), uint8 [B, 8] in 0..63 -> the 12-byte Q4_K/Q5_K scale fields [B, 12]."""
    lo = scales[:, :4] | ((scales[:, 4:] >> 4) << 6)
    mid = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    hi = (scales[:, 4:] & 15) | ((mins[:, 4:] & 15) << 4)
    return np.concatenate([lo, mid, hi], axis=1)


def _k_min_codes(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: blocks [B, 256] -> (header bytes [B, 16], q codes uint8 [B, 8, 32])."""
    sub = x.reshape(-1, 8, 32)
    need_min = np.maximum(-sub.min(axis=2), np.float32(0))  # [B, 8]
    dmin = _f16_round_up(need_min.max(axis=1) / np.float32(63), "dmin").astype(np.float32)
    mins = _ceil_div(need_min, dmin[:, None], 63)
    offset = dmin[:, None] * mins.astype(np.float32)
    need_step = np.maximum(sub.max(axis=2) + offset, np.float32(0)) / np.float32(levels)
    d = _f16_round_up(need_step.max(axis=1) / np.float32(63), "d").astype(np.float32)
    scales = _ceil_div(need_step, d[:, None], 63)
    step = d[:, None] * scales.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(step > 0, np.float32(1) / step, np.float32(0))
    q = np.clip(np.rint((sub + offset[:, :, None]) * inv[:, :, None]), 0, levels).astype(np.uint8)
    head = np.empty((sub.shape[0], 16), dtype=np.uint8)
    _store_f16(head, 0, d)
    _store_f16(head, 2, dmin)
    head[:, 4:] = pack_k_scales(scales.astype(np.uint8), mins.astype(np.uint8))
    return head, q


def _k_nibble_bytes(q: np.ndarray) -> np.ndarray:
    """q codes [B, 8, 32] (low four bits used) -> 128 bytes [B, 128]: sub-block 2g in the low
    nibbles of 32-byte group g, sub-block 2g+1 in its high nibbles."""
    pairs = (q & 15).reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def _quant_q4_k(x: np.ndarray) -> np.ndarray:
    head, q = _k_min_codes(x, 15)
    return np.concatenate([head, _k_nibble_bytes(q)], axis=1)


def _quant_q5_k(x: np.ndarray) -> np.ndarray:
    head, q = _k_min_codes(x, 31)
    bit = np.arange(8, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce(((q >> 4) & 1) << bit, axis=1)  # [B, 32]
    return np.concatenate([head, qh, _k_nibble_bytes(q)], axis=1)


def _quant_q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    need_step = np.abs(sub).max(axis=2) / np.float32(31)  # [B, 16]
    d = _f16_round_up(need_step.max(axis=1) / np.float32(127), "d").astype(np.float32)
    scales = _ceil_div(need_step, d[:, None], 127)
    step = d[:, None] * scales.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(step > 0, np.float32(1) / step, np.float32(0))
    codes = np.clip(np.rint(sub * inv[:, :, None]), -32, 31) + 32
    u = codes.astype(np.uint8).reshape(-1, 2, 4, 32)  # half, quarter, l
    ql = (u[:, :, 0:2] & 15) | ((u[:, :, 2:4] & 15) << 4)  # half, 32-byte group, l
    shift = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    qh = np.bitwise_or.reduce(((u >> 4) & 3) << shift, axis=2)  # half, l
    out = np.empty((sub.shape[0], 210), dtype=np.uint8)
    out[:, 0:128] = ql.reshape(-1, 128)
    out[:, 128:192] = qh.reshape(-1, 64)
    out[:, 192:208] = scales.astype(np.int8).view(np.uint8)
    _store_f16(out, 208, d)
    return out


def _quant_f32(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, 1).view(np.uint8)


def _quant_f16(x: np.ndarray) -> np.ndarray:
    if np.any(np.abs(x) > _F16_MAX):
        raise ValueError("values beyond the f16 range cannot be stored as F16")
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _quant_bf16(x: np.ndarray) -> np.ndarray:
    bits = x.view(np.uint32)
    top = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    if np.any((top & 0x7FFF) == 0x7F80):
        raise ValueError("values round beyond the bf16 range")
    return top.reshape(-1, 1).view(np.uint8)


def _quant_mxfp4(x: np.ndarray) -> np.ndarray:
    import torch

    from freetoken.quant.mxfp4 import checkpoint_to_ggml, quantize_mxfp4

    blocks, scales = quantize_mxfp4(torch.from_numpy(x.reshape(-1, 32)))
    return checkpoint_to_ggml(blocks, scales).reshape(-1, 17).numpy()


_QUANT = {
    GGMLType.F32: _quant_f32,
    GGMLType.F16: _quant_f16,
    GGMLType.Q8_0: _quant_q8_0,
    GGMLType.Q4_K: _quant_q4_k,
    GGMLType.Q5_K: _quant_q5_k,
    GGMLType.Q6_K: _quant_q6_k,
    GGMLType.BF16: _quant_bf16,
    GGMLType.MXFP4: _quant_mxfp4,
}


def _as_rows(qtype: GGMLType, x: np.ndarray) -> np.ndarray:
    if x.dtype != np.float32:
        raise ValueError(f"quantize takes float32 values, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError("quantize takes rows [..., n], got a scalar")
    row_bytes(qtype, x.shape[-1])  # whole blocks, or a ValueError naming the type
    if not np.all(np.isfinite(x)):
        raise ValueError(f"cannot quantize non-finite values to {qtype.name}")
    return np.ascontiguousarray(x)


def quantize(qtype: GGMLType, x: np.ndarray, workers: int | None = None) -> np.ndarray:
    """float32 rows [..., n] -> uint8 [..., row_bytes(qtype, n)] of `qtype` blocks, chunks in
    parallel over `workers` threads (default: every core)."""
    qtype = GGMLType(qtype)
    x = _as_rows(qtype, x)
    n = x.shape[-1]
    rb = row_bytes(qtype, n)
    flat = x.reshape(-1)
    out = np.empty((flat.size // BLOCK_SIZES[qtype][0], BLOCK_SIZES[qtype][1]), dtype=np.uint8)
    block = BLOCK_SIZES[qtype][0]
    chunk = max(block, _CHUNK_ELEMS // block * block)
    starts = range(0, flat.size, chunk)

    def one(start: int) -> None:
        stop = min(flat.size, start + chunk)
        out[start // block : stop // block] = _QUANT[qtype](flat[start:stop])

    workers = workers or os.cpu_count() or 1
    if workers == 1 or len(starts) == 1:
        for start in starts:
            one(start)
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(one, starts))
    return out.reshape(*x.shape[:-1], rb)


def error_bound(qtype: GGMLType, x: np.ndarray) -> np.ndarray:
    """The largest |x - dequantize(quantize(x))| the module docstring promises, per element
    of float32 rows [..., n] (same shape as x)."""
    qtype = GGMLType(qtype)
    x = _as_rows(qtype, x)
    mag = np.abs(x).astype(np.float64)
    if qtype == GGMLType.F32:
        return np.zeros_like(mag)
    if qtype == GGMLType.F16:
        return np.maximum(mag * 2.0**-11, 2.0**-25)
    if qtype == GGMLType.BF16:
        return mag * 2.0**-8
    block = BLOCK_SIZES[qtype][0]
    peak = mag.reshape(-1, block).max(axis=1, keepdims=True)  # A per block
    slack = peak * 2.0**-18  # float32 rounding in the arithmetic
    if qtype == GGMLType.MXFP4:
        with np.errstate(divide="ignore"):
            exponent = np.maximum(np.ceil(np.log2(peak / 6)), -127)
        bound = np.where(peak > 0, np.exp2(exponent), 0.0)
    elif qtype == GGMLType.Q8_0:
        d = peak / 127
        bound = d / 2 + 127 * np.maximum(d * 2.0**-11, 2.0**-25)
    elif qtype == GGMLType.Q6_K:
        step = peak / 31
        bound = (step + step / 127 * (1 + _F16_REL) + _F16_TINY) / 2
    else:
        levels = 15 if qtype == GGMLType.Q4_K else 31
        dmin = peak / 63 * (1 + _F16_REL) + _F16_TINY
        step = (2 * peak + dmin) / levels
        bound = (step + step / 63 * (1 + _F16_REL) + _F16_TINY) / 2
    return np.broadcast_to(bound + slack, (peak.shape[0], block)).reshape(x.shape)
