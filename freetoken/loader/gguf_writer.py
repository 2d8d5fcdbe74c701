"""Write an MoE model as one GGUF file llama.cpp loads, streamed tensor by tensor.

What llama.cpp needs from a file we write: the architecture's hyperparameter keys (`qwen3moe`'s
here; the hybrid Qwens' and gpt-oss's extra rows come from `loader/gguf_hybrid.py` and
`loader/gguf_gpt_oss.py`), a GPT-2 style
byte-level BPE tokenizer (`tokenizer.ggml.*`: tokens padded with unused entries up to the
model's vocabulary, token types, merges, bos/eos/pad ids, the `qwen2` pre-tokenizer) and the
chat template, then every tensor under its GGUF name. Tensors are stacked per layer for the
experts (`blk.N.ffn_{gate,up,down}_exps.weight`, [E, out, in]) and stored row-major with the
row along the input dimension, as safetensors keep them.

Memory stays about one tensor: every tensor's type and size is declared first, then each is
produced, quantized and written in turn (a producer may hand over its blocks already in the
type: gpt-oss's MXFP4 experts, repacked, never requantized). The file appears under its name
only when complete.

File types follow llama.cpp's mixes in spirit (`tensor_type`): the main type everywhere, 1-D
tensors, norms, the routers and the DeltaNet's conv in F32 (as its converter keeps them), and
for the K-quant "M" mixes Q6_K for the output head and for the value and expert down projections
of the layers that matter most. `MXFP4` is gpt-oss's: MXFP4 experts, BF16 for the rest.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from freetoken.progress import Progress
from freetoken.quant.ggml_blocks import BLOCK_SIZES, GGMLType, row_bytes
from freetoken.quant.quantize import quantize

GGUF_ARCH = "qwen3moe"

# file type name -> (main type, the type of the tensors that get more bits)
FILE_TYPES: dict[str, tuple[GGMLType, GGMLType]] = {
    "Q8_0": (GGMLType.Q8_0, GGMLType.Q8_0),
    "Q4_K_M": (GGMLType.Q4_K, GGMLType.Q6_K),
    "Q5_K_M": (GGMLType.Q5_K, GGMLType.Q6_K),
    "Q6_K": (GGMLType.Q6_K, GGMLType.Q6_K),
    "BF16": (GGMLType.BF16, GGMLType.BF16),
    "F32": (GGMLType.F32, GGMLType.F32),
    "MXFP4": (GGMLType.BF16, GGMLType.BF16),  # and the experts MXFP4 (_EXPERT_TYPES)
}
# file types whose routed experts take a type of their own, and llama.cpp's name of that file type
_EXPERT_TYPES = {"MXFP4": GGMLType.MXFP4}
_LLAMA_FILE_TYPE_NAMES = {"F32": "ALL_F32", "MXFP4": "MOSTLY_MXFP4_MOE"}
_EXPERT_ROLES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")

# Roles llama.cpp's converter always keeps in F32 besides norms: the routers (routed and the
# shared expert's gate), the DeltaNet's conv kernel, its decay rates and time-step bias.
_F32_ROLES = ("ffn_gate_inp", "ffn_gate_inp_shexp", "ssm_conv1d", "ssm_a", "ssm_dt")

# Projections whose quantization error costs the most, given more bits in some layers.
_SENSITIVE = ("attn_v", "ffn_down_exps")


class Qwen3MoeHyper(msgspec.Struct, frozen=True, kw_only=True):
    """The hyperparameters and special ids a qwen3moe GGUF declares (the hybrid Qwens declare
    these too, with no dense MLP size where their config has none)."""

    context_length: int
    hidden_size: int
    num_layers: int
    dense_intermediate_size: int | None
    expert_intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    num_experts: int
    top_k: int
    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int | None


class GGUFTensor(msgspec.Struct, frozen=True):
    """One tensor to write: GGUF name, numpy shape (row last), type, and a producer (called once,
    when the tensor's turn comes) of its float32 values, or of its blocks already in the type
    (uint8 [*shape[:-1], row bytes])."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLType
    produce: Callable[[], np.ndarray]


def parse_file_type(name: str) -> str:
    key = name.strip().upper()
    if key not in FILE_TYPES:
        raise ValueError(f"unknown GGUF file type {name!r}; choose one of: {', '.join(FILE_TYPES)}")
    return key


def _gets_more_bits(layer: int, num_layers: int) -> bool:
    """The first eighth, the last eighth and every third layer between them."""
    eighth = num_layers / 8
    return layer < eighth or layer >= num_layers - eighth or (layer - int(eighth)) % 3 == 2


def tensor_type(file_type: str, role: str, layer: int | None, num_layers: int) -> GGMLType:
    """The type of a tensor of `role` (its GGUF name without `blk.N.` and `.weight`) in
    `file_type`. 1-D tensors, the routers and the conv kernel stay F32, as llama.cpp keeps them."""
    key = parse_file_type(file_type)
    main, more = FILE_TYPES[key]
    if key in _EXPERT_TYPES and role in _EXPERT_ROLES:
        return _EXPERT_TYPES[key]
    if role.endswith("norm") or role in _F32_ROLES:
        return GGMLType.F32
    if role == "output":
        return more
    if role in _SENSITIVE and layer is not None and _gets_more_bits(layer, num_layers):
        return more
    return main


def _llama_file_type(file_type: str) -> int:
    import gguf

    key = parse_file_type(file_type)
    return int(getattr(gguf.LlamaFileType, _LLAMA_FILE_TYPE_NAMES.get(key, "MOSTLY_" + key)))


def add_tokenizer(writer, tokenizer_json: str, vocab_size: int, chat_template: str | None,
                  pre_tokenizer: str = "qwen2") -> None:
    """`tokenizer.ggml.*` from a byte-level BPE `tokenizer.json`, padded to `vocab_size`;
    `pre_tokenizer` names llama.cpp's pre-tokenizer regex (`qwen2`, `qwen35`)."""
    import gguf

    tok = json.loads(tokenizer_json)
    if tok.get("model", {}).get("type") != "BPE":
        raise ValueError("the GGUF writer takes byte-level BPE tokenizers only")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for text, i in tok["model"]["vocab"].items():
        if i < vocab_size:
            tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for added in tok.get("added_tokens", []):
        i = added["id"]
        if i < vocab_size:
            tokens[i] = added["content"]
            types[i] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_add_bos_token(False)
    if chat_template:
        writer.add_chat_template(chat_template)


def _add_hyperparameters(writer, hp: Qwen3MoeHyper, file_type: str, name: str) -> None:
    import gguf

    writer.add_name(name)
    writer.add_context_length(hp.context_length)
    writer.add_embedding_length(hp.hidden_size)
    writer.add_block_count(hp.num_layers)
    if hp.dense_intermediate_size is not None:
        writer.add_feed_forward_length(hp.dense_intermediate_size)
    writer.add_expert_feed_forward_length(hp.expert_intermediate_size)
    writer.add_head_count(hp.num_heads)
    writer.add_head_count_kv(hp.num_kv_heads)
    writer.add_key_length(hp.head_dim)
    writer.add_value_length(hp.head_dim)
    writer.add_rope_freq_base(hp.rope_theta)
    writer.add_layer_norm_rms_eps(hp.rms_norm_eps)
    writer.add_expert_count(hp.num_experts)
    writer.add_expert_used_count(hp.top_k)
    writer.add_file_type(_llama_file_type(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if hp.bos_id is not None:
        writer.add_bos_token_id(hp.bos_id)
    writer.add_eos_token_id(hp.eos_id)
    if hp.pad_id is not None:
        writer.add_pad_token_id(hp.pad_id)


def add_metadata_row(writer, key: str, value: Any) -> None:
    """One `{arch}.key` = value row, typed as llama.cpp reads it: bool, uint32, float32, string,
    or an array of those."""
    full = f"{writer.arch}.{key}"
    if isinstance(value, (list, tuple)):
        writer.add_array(full, list(value))
    elif isinstance(value, bool):
        writer.add_bool(full, value)
    elif isinstance(value, int):
        writer.add_uint32(full, value)
    elif isinstance(value, float):
        writer.add_float32(full, value)
    elif isinstance(value, str):
        writer.add_string(full, value)
    else:
        raise TypeError(f"metadata row {full}: no GGUF type for {type(value).__name__}")


def check_rows(tensors: Sequence[GGUFTensor]) -> None:
    """Every row must be whole blocks of its tensor's type; the error names the tensor."""
    for t in tensors:
        try:
            row_bytes(t.qtype, t.shape[-1])
        except ValueError:
            raise ValueError(
                f"tensor {t.name}: rows of {t.shape[-1]} elements are not whole {t.qtype.name} blocks "
                f"(a multiple of {BLOCK_SIZES[t.qtype][0]} is needed); pick a shape "
                "whose hidden size and expert intermediate size fit, or another GGUF type"
            ) from None


def _stored(t: GGUFTensor, values: np.ndarray) -> np.ndarray:
    """A producer's output as the bytes to write: float32 values quantized, blocks as they are."""
    byte_shape = (*t.shape[:-1], row_bytes(t.qtype, t.shape[-1]))
    if values.dtype == np.uint8 and values.shape == byte_shape:
        return values
    if values.shape != t.shape or values.dtype != np.float32:
        raise ValueError(f"tensor {t.name}: produced {values.dtype} {values.shape}, declared float32 {t.shape} "
                         f"(or its {t.qtype.name} blocks, uint8 {byte_shape})")
    return quantize(t.qtype, values)


def write_gguf(
    path: str | Path,
    hp: Qwen3MoeHyper,
    tensors: Sequence[GGUFTensor],
    *,
    file_type: str,
    tokenizer_json: str,
    chat_template: str | None,
    name: str,
    progress: Progress | None = None,
    arch: str = GGUF_ARCH,
    extra_metadata: Sequence[tuple[str, Any]] = (),
    pre_tokenizer: str = "qwen2",
) -> Path:
    """Write `tensors` with `hp`'s metadata, the `arch`-relative `extra_metadata` rows and the
    tokenizer as one GGUF file of architecture `arch` at `path`; `progress` (opened by the
    caller, one unit per tensor) advances as each tensor is written."""
    import gguf

    check_rows(tensors)
    out = Path(path)
    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        _add_hyperparameters(writer, hp, file_type, name)
        for key, value in extra_metadata:
            add_metadata_row(writer, key, value)
        add_tokenizer(writer, tokenizer_json, hp.vocab_size, chat_template, pre_tokenizer)
        for t in tensors:
            byte_shape = (*t.shape[:-1], row_bytes(t.qtype, t.shape[-1]))
            qtype = gguf.GGMLQuantizationType(int(t.qtype))
            writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            writer.write_tensor_data(_stored(t, t.produce()))
            if progress is not None:
                progress.advance(1, f"{t.name} {t.qtype.name}")
        writer.close()
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)
    return out
