"""MXFP4, the OCP microscaling format gpt-oss ships its experts in: blocks of 32 values, each an
FP4 (E2M1) code, sharing one power-of-two scale (an E8M0 byte, exponent bias 127).

As the checkpoints store it (`*_blocks`, `*_scales` tensors of gpt-oss's experts):
    blocks [..., G, 16] uint8   32 codes per block, two per byte: the low nibble is the even
                                 element, the high nibble the odd one
    scales [..., G]     uint8   the block's exponent e: its values are code * 2**(e - 127)
    -> values [..., G * 32]

As GGUF files store it (GGML type MXFP4, llama.cpp's gpt-oss experts), the same numbers in
another order: one 17-byte block per 32 values, the scale byte first, then 16 bytes whose low
nibbles hold elements 0..15 and high nibbles elements 16..31. `ggml_to_checkpoint` and
`checkpoint_to_ggml` move codes between the two orders without touching a value.

Every MXFP4 value (a code with at most one mantissa bit, times a power of two) is exact in bf16
down to 2**-133, so dequantizing into bf16 loses nothing for the scales real weights take.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per block
BLOCK_BYTES = BLOCK // 2  # bytes of codes per block (the scale byte is a separate tensor)
GGML_BLOCK_BYTES = 1 + BLOCK_BYTES  # a GGUF block: the scale byte, then the codes
EXPONENT_BIAS = 127
# E2M1 codes 0..15: sign bit 3, then exponent and mantissa; the magnitudes are 0, 0.5, 1, ..., 6
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MAX_CODE = 6.0
# between adjacent magnitudes: a value's nearest magnitude is the number of midpoints below it
# (one on a midpoint takes the smaller magnitude)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_CHUNK_VALUES = 1 << 22  # values quantized at once (a few floats each)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G*32] in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK_BYTES or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected blocks [..., G, {BLOCK_BYTES}] and scales [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], BLOCK)  # even, odd
    exponent = scales.to(torch.int32) - EXPONENT_BIAS
    values = torch.ldexp(lut[codes.long()], exponent.unsqueeze(-1).to(torch.float32))
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK).to(dtype)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of 32) -> (blocks [..., K/32, 16], scales [..., K/32]): each
    block's exponent is the smallest that brings its largest magnitude within the codes' 6, and
    each value takes the nearest code (the synthetic checkpoints' quantizer; loading never
    quantizes). Rows are quantized a few million values at a time, so memory stays bounded at
    any tensor size; every block is quantized on its own, so the chunks change nothing."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 quantizes rows of a multiple of {BLOCK} values, got {x.shape[-1]}")
    groups = x.shape[-1] // BLOCK
    rows = x.reshape(-1, x.shape[-1])
    blocks = torch.empty(rows.shape[0], groups, BLOCK_BYTES, dtype=torch.uint8)
    scales = torch.empty(rows.shape[0], groups, dtype=torch.uint8)
    step = max(1, _CHUNK_VALUES // max(1, x.shape[-1]))
    for start in range(0, rows.shape[0], step):
        blocks[start : start + step], scales[start : start + step] = _quantize_rows(rows[start : start + step])
    return blocks.reshape(*x.shape[:-1], groups, BLOCK_BYTES), scales.reshape(*x.shape[:-1], groups)


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    groups = x.float().reshape(x.shape[0], x.shape[-1] // BLOCK, BLOCK)
    amax = groups.abs().amax(dim=-1)
    exponent = torch.ceil(torch.log2(torch.where(amax > 0, amax / _MAX_CODE, torch.ones_like(amax))))
    exponent = exponent.clamp(-EXPONENT_BIAS, EXPONENT_BIAS)
    scaled = groups / torch.ldexp(torch.ones_like(exponent), exponent).unsqueeze(-1)
    nearest = torch.bucketize(scaled.abs(), torch.tensor(_MIDPOINTS))  # 0..7
    codes = (nearest | ((scaled < 0) & (nearest > 0)).long() << 3).to(torch.uint8)
    pairs = codes.reshape(*codes.shape[:-1], BLOCK_BYTES, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks, (exponent.to(torch.int32) + EXPONENT_BIAS).to(torch.uint8)


def ggml_to_checkpoint(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF blocks uint8 [..., G, 17] -> the checkpoint's (blocks [..., G, 16], scales [..., G]):
    the same codes, paired even/odd instead of j/j+16."""
    if raw.dtype != torch.uint8 or raw.shape[-1] != GGML_BLOCK_BYTES:
        raise ValueError(f"GGML MXFP4 blocks are uint8 [..., {GGML_BLOCK_BYTES}], got {raw.dtype} {tuple(raw.shape)}")
    qs = raw[..., 1:]
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # elements 0..31 in order
    return codes[..., 0::2] | (codes[..., 1::2] << 4), raw[..., 0].contiguous()


def checkpoint_to_ggml(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The checkpoint's (blocks [..., G, 16], scales [..., G]) -> GGUF blocks uint8 [..., G, 17]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[-1] != BLOCK_BYTES \
            or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected uint8 blocks [..., G, {BLOCK_BYTES}] and scales [..., G])")
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], BLOCK)
    qs = codes[..., :BLOCK_BYTES] | (codes[..., BLOCK_BYTES:] << 4)
    return torch.cat((scales.unsqueeze(-1), qs), dim=-1)
