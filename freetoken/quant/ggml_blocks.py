"""GGML block formats: type ids, block sizes, and vectorised numpy dequantization.

A row of `n` elements (GGUF's ne0, the input dimension of a weight) is `n / block_elems`
consecutive blocks. Layouts, one block each (f16 = IEEE half, little-endian):

- Q8_0, 32 elements, 34 bytes: f16 d, int8 q[32]; x = d * q.
- Q4_K, 256 elements, 144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit sub-block scales and
  mins, 128 bytes of 4-bit q. Eight sub-blocks of 32; x = (d * sc) * q - (dmin * m).
  Scale bytes: for sub-blocks 0-3, sc = b[j] & 63 and m = b[j+4] & 63; for 4-7 the low four
  bits come from b[j+4] (sc low nibble, m high nibble) and the top two from b[j-4] / b[j] >> 6.
  q bytes: 32-byte group g holds sub-block 2g in its low nibbles, 2g+1 in its high ones.
- Q5_K, 256 elements, 176 bytes: as Q4_K plus qh[32] before the 4-bit bytes: bit i of
  qh[l] is the fifth bit of element l of sub-block i.
- Q6_K, 256 elements, 210 bytes: ql[128], qh[64], int8 scales[16], f16 d. Sixteen
  sub-blocks of 16; x = (d * scale[e // 16]) * (q - 32) with q six bits. Each 128-element
  half h uses ql[64h:64h+64] and qh[32h:32h+32]; its quarter k (32 elements, l = 0..31)
  takes the low (k < 2) or high (k >= 2) nibble of ql[32 * (k % 2) + l] and bits
  2k, 2k+1 of qh[l].
- MXFP4, 32 elements, 17 bytes: an E8M0 exponent byte e, then 16 bytes whose low nibbles
  are elements 0..15 and high nibbles 16..31, each an E2M1 code; x = 2^(e-127) * code
  (gpt-oss's experts; quant/mxfp4.py holds the checkpoints' order of the same codes).
- F32, F16, BF16: one element per block, stored as is (BF16 = the top half of an f32).

Shapes: data uint8 [..., row_bytes(qtype, n)] -> float32 [..., n].
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np


class GGMLType(IntEnum):
    """The GGUF tensor type ids of the formats we read and write."""

    F32 = 0
    F16 = 1
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30
    MXFP4 = 39


# type -> (elements per block, bytes per block)
BLOCK_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
    GGMLType.BF16: (1, 2),
    GGMLType.MXFP4: (32, 17),
}


def parse_type(name: str) -> GGMLType:
    """`GGMLType` from a name such as "Q4_K" or "q8_0"; ValueError listing the accepted ones."""
    key = name.strip().upper()
    if key not in GGMLType.__members__:
        raise ValueError(f"unknown GGML type {name!r}; accepted: {', '.join(GGMLType.__members__)}")
    return GGMLType[key]


def row_bytes(qtype: GGMLType, n: int) -> int:
    """Bytes of a row of `n` elements; ValueError when `n` is not a whole number of blocks."""
    elems, nbytes = BLOCK_SIZES[GGMLType(qtype)]
    if n < 0 or n % elems:
        raise ValueError(f"a {GGMLType(qtype).name} row holds whole blocks of {elems} elements; got {n}")
    return n // elems * nbytes


def _blocks(data: np.ndarray, qtype: GGMLType, n: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """The bytes as [blocks, bytes_per_block] plus the leading shape of the rows."""
    expect = row_bytes(qtype, n)
    if data.dtype != np.uint8:
        raise ValueError(f"{qtype.name} data must be uint8 bytes, got {data.dtype}")
    if data.ndim == 0 or data.shape[-1] != expect:
        raise ValueError(f"{qtype.name} rows of {n} elements are {expect} bytes; data has shape {data.shape}")
    per_block = BLOCK_SIZES[qtype][1]
    return np.ascontiguousarray(data).reshape(-1, per_block), data.shape[:-1]


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The f16 field at byte `start` of every block, as float32 [blocks, 1]."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def unpack_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12-byte scale fields [B, 12] -> (scales, mins), each uint8 [B, 8] in 0..63."""
    lo, mid, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=1)
    mins = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return scales, mins


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes of 4-bit q [B, 128] -> uint8 [B, 8, 32] (sub-block, element)."""
    groups = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([groups & 15, groups >> 4], axis=2).reshape(-1, 8, 32)


def _dequant_q8_0(blocks: np.ndarray) -> np.ndarray:
    return blocks[:, 2:].view(np.int8).astype(np.float32) * _f16(blocks, 0)


def _dequant_k_min(blocks: np.ndarray, q: np.ndarray) -> np.ndarray:
    """x = (d * sc) * q - (dmin * m) per sub-block of 32, for Q4_K and Q5_K."""
    scales, mins = unpack_k_scales(blocks[:, 4:16])
    step = _f16(blocks, 0) * scales.astype(np.float32)
    offset = _f16(blocks, 2) * mins.astype(np.float32)
    return (step[:, :, None] * q.astype(np.float32) - offset[:, :, None]).reshape(-1, 256)


def _dequant_q4_k(blocks: np.ndarray) -> np.ndarray:
    return _dequant_k_min(blocks, _k_nibbles(blocks[:, 16:144]))


def _dequant_q5_k(blocks: np.ndarray) -> np.ndarray:
    qh = blocks[:, 16:48]
    bit = np.arange(8, dtype=np.uint8)[None, :, None]
    high = ((qh[:, None, :] >> bit) & 1) << 4
    return _dequant_k_min(blocks, _k_nibbles(blocks[:, 48:176]) | high)


def _dequant_q6_k(blocks: np.ndarray) -> np.ndarray:
    ql = blocks[:, 0:128].reshape(-1, 2, 2, 32)  # half, 32-byte group, l
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)  # half, -, l
    low = np.concatenate([ql & 15, ql >> 4], axis=2)  # half, quarter, l
    shift = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    q = (low | (((qh >> shift) & 3) << 4)).astype(np.int8) - np.int8(32)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    step = _f16(blocks, 208) * scales  # [B, 16]
    return (step[:, :, None] * q.reshape(-1, 16, 16).astype(np.float32)).reshape(-1, 256)


# E2M1 codes doubled (0, 0.5, 1, ... as 0, 1, 2, ...), times half the scale: the integers keep
# the products gguf's and ggml's, bit for bit (zero is +0 for both signs).
_E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)


def _dequant_mxfp4(blocks: np.ndarray) -> np.ndarray:
    e = blocks[:, :1].astype(np.uint32)
    # 2^(e-128) as float32 bits: subnormal for e < 2, else the exponent field e - 1
    half = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23)).view(np.float32)
    qs = blocks[:, 1:]
    return half * _E2M1_DOUBLED[np.concatenate([qs & 15, qs >> 4], axis=1)]


def _dequant_f32(blocks: np.ndarray) -> np.ndarray:
    return blocks.view(np.float32).copy()


def _dequant_f16(blocks: np.ndarray) -> np.ndarray:
    return blocks.view(np.float16).astype(np.float32)


def _dequant_bf16(blocks: np.ndarray) -> np.ndarray:
    return (blocks.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


_DEQUANT = {
    GGMLType.F32: _dequant_f32,
    GGMLType.F16: _dequant_f16,
    GGMLType.Q8_0: _dequant_q8_0,
    GGMLType.Q4_K: _dequant_q4_k,
    GGMLType.Q5_K: _dequant_q5_k,
    GGMLType.Q6_K: _dequant_q6_k,
    GGMLType.BF16: _dequant_bf16,
    GGMLType.MXFP4: _dequant_mxfp4,
}


def dequantize(qtype: GGMLType, data: np.ndarray, n: int) -> np.ndarray:
    """Rows of `qtype` blocks, uint8 [..., row_bytes(qtype, n)] -> float32 [..., n]."""
    qtype = GGMLType(qtype)
    blocks, lead = _blocks(data, qtype, n)
    return _DEQUANT[qtype](blocks).reshape(*lead, n)
