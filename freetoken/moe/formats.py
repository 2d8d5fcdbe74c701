"""The expert-format table: which format a checkpoint's experts are kept in, in the host pool and
in the device slots. The only place that chooses one.

Each row is a detector: from the open checkpoint (a `TensorReader`; a GGUF file's reader carries
the file as `.gguf`), its config and the compute dtype, it returns a format, or None when the
experts are not of its kind; it raises `CheckpointError` for experts of its kind that it cannot
hold. The first answer wins; the last row answers for every float checkpoint. A new expert format
is its module (the format's interface: `banks`, `read_layer`, `slot_gemm`, `prefill_gemm`, the
CPU layout; moe/expert_format.py), its kernels, and one row here.
"""

from __future__ import annotations

import torch

from freetoken.config import ModelConfig
from freetoken.moe.biased_expert_format import format_for_model
from freetoken.moe.block_format import block_format_for
from freetoken.moe.mxfp4_format import mxfp4_format_for


def _gguf_blocks(reader, config: ModelConfig, compute_dtype: torch.dtype):
    """GGML block-quantized experts of a GGUF file (moe/block_format.py)."""
    gguf = getattr(reader, "gguf", None)
    return None if gguf is None else block_format_for(gguf, config)


def _mxfp4(reader, config: ModelConfig, compute_dtype: torch.dtype):
    """gpt-oss's MXFP4 experts (moe/mxfp4_format.py), as a safetensors checkpoint stores them or
    a GGUF file's read under those names (loader/gguf_mxfp4.py)."""
    return mxfp4_format_for(reader, config)


def _floats(reader, config: ModelConfig, compute_dtype: torch.dtype):
    """Unquantized experts, in the dtype that rounds nothing the compute dtype would see, with
    biases and the clamped SwiGLU where the family has them (moe/expert_format.py,
    moe/biased_expert_format.py)."""
    return format_for_model(reader, config, compute_dtype)


DETECTORS = (_gguf_blocks, _mxfp4, _floats)


def expert_format_for(reader, config: ModelConfig, compute_dtype: torch.dtype):
    """The format the pool and the slots keep this checkpoint's experts in."""
    for detect in DETECTORS:
        fmt = detect(reader, config, compute_dtype)
        if fmt is not None:
            return fmt
    raise AssertionError("the last detector answers for every checkpoint")
