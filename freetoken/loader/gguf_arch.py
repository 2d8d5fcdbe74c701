"""The GGUF architecture table: what a GGUF file's metadata and tensor names mean to freetoken.

One row per GGUF architecture (`general.architecture`): our architecture name, which metadata
key (under `{arch}.`) holds which `config.json` field, the fields GGUF does not store (set as
llama.cpp runs the family), and GGUF tensor names -> the transformers names the loader asks for.
A config is built as the `config.json` dict the row describes and normalised by
`ModelConfig.from_hf_dict`, so a GGUF model is checked as strictly as a transformers one.

A new family is a new row. q/k weights need no un-permuting for the rows here: llama.cpp's
converter permutes them only for llama-style rotary, and the qwen families and gpt-oss use the
same half-split rotary as transformers, so their GGUF q/k are in transformers' order. A row's
`extra` reads what is not one key per field (gpt-oss's YaRN and sliding layers); its `experts`
names how the expert tensors are read: `stacked` (a float or block-quantized tensor per
projection, loader/gguf_reader.py) or `mxfp4` (gpt-oss's, loader/gguf_mxfp4.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from freetoken.errors import CheckpointError
from freetoken.loader import gguf_gpt_oss
from freetoken.loader.gguf_file import GgufFile

# The tensor names every row shares ({n}: the layer); GGUF names on the left.
_COMMON_TENSORS = (
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("blk.{n}.attn_norm.weight", "model.layers.{n}.input_layernorm.weight"),
    ("blk.{n}.ffn_norm.weight", "model.layers.{n}.post_attention_layernorm.weight"),
    ("blk.{n}.attn_q.weight", "model.layers.{n}.self_attn.q_proj.weight"),
    ("blk.{n}.attn_k.weight", "model.layers.{n}.self_attn.k_proj.weight"),
    ("blk.{n}.attn_v.weight", "model.layers.{n}.self_attn.v_proj.weight"),
    ("blk.{n}.attn_output.weight", "model.layers.{n}.self_attn.o_proj.weight"),
    ("blk.{n}.attn_q.bias", "model.layers.{n}.self_attn.q_proj.bias"),
    ("blk.{n}.attn_k.bias", "model.layers.{n}.self_attn.k_proj.bias"),
    ("blk.{n}.attn_v.bias", "model.layers.{n}.self_attn.v_proj.bias"),
    ("blk.{n}.attn_output.bias", "model.layers.{n}.self_attn.o_proj.bias"),
    ("blk.{n}.ffn_gate_inp.weight", "model.layers.{n}.mlp.gate.weight"),
    ("blk.{n}.ffn_gate.weight", "model.layers.{n}.mlp.gate_proj.weight"),  # a dense layer's MLP
    ("blk.{n}.ffn_up.weight", "model.layers.{n}.mlp.up_proj.weight"),
    ("blk.{n}.ffn_down.weight", "model.layers.{n}.mlp.down_proj.weight"),
)
# The routed experts, one tensor per projection [E, rows, cols]; the reader serves them under
# transformers' fused names (models/family.py: gate_up_proj [E, 2I, H], down_proj [E, H, I]).
EXPERT_TENSOR = "blk.{n}.ffn_{proj}_exps.weight"
FUSED_EXPERT_TENSORS = {
    "model.layers.{n}.mlp.experts.gate_up_proj": ("gate", "up"),
    "model.layers.{n}.mlp.experts.down_proj": ("down",),
}

# config.json field -> metadata key under `{arch}.`, for every row
_COMMON_KEYS = {
    "num_hidden_layers": "block_count",
    "hidden_size": "embedding_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "num_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
    "intermediate_size": "feed_forward_length",
    "rope_theta": "rope.freq_base",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "max_position_embeddings": "context_length",
}
# keys a file must hold (the others default as config.json's fields do)
_REQUIRED_KEYS = (
    "block_count", "embedding_length", "attention.head_count", "expert_count", "expert_used_count",
    "expert_feed_forward_length", "attention.layer_norm_rms_epsilon",
)


def _default_rope(gguf: GgufFile, prefix: str, layers: int) -> dict[str, Any]:
    """The rows' rotary unless they say otherwise: the default one, scaling refused."""
    scaling = gguf.get(prefix + "rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise CheckpointError(
            f"{gguf.path}: {prefix}rope.scaling.type: {scaling!r} is not supported (only default RoPE)"
        )
    return {}


@dataclass(frozen=True)
class GgufArch:
    gguf_name: str  # general.architecture
    arch: str  # ModelConfig.arch (config.json's model_type)
    config_keys: dict[str, str] = field(default_factory=lambda: dict(_COMMON_KEYS))
    required_keys: tuple[str, ...] = _REQUIRED_KEYS
    # config.json fields GGUF does not store, as llama.cpp runs the family
    fixed: dict[str, Any] = field(default_factory=dict)
    tensors: tuple[tuple[str, str], ...] = _COMMON_TENSORS
    # (file, "{arch}.", layers) -> the config.json fields not one key each
    extra: Callable[[GgufFile, str, int], dict[str, Any]] = _default_rope
    experts: Literal["stacked", "mxfp4"] = "stacked"


# gpt-oss's intermediate_size is its experts' (llama.cpp reads expert_feed_forward_length)
_GPT_OSS_KEYS = {**{k: v for k, v in _COMMON_KEYS.items() if k not in ("intermediate_size", "moe_intermediate_size")},
                 "intermediate_size": "expert_feed_forward_length", "sliding_window": "attention.sliding_window"}

ARCHS = {
    row.gguf_name: row
    for row in (
        # llama.cpp renormalises qwen3moe's top-k weights whatever config.json said
        GgufArch("qwen3moe", "qwen3_moe", fixed={"norm_topk_prob": True}, tensors=(
            *_COMMON_TENSORS,
            ("blk.{n}.attn_q_norm.weight", "model.layers.{n}.self_attn.q_norm.weight"),
            ("blk.{n}.attn_k_norm.weight", "model.layers.{n}.self_attn.k_norm.weight"),
        )),
        GgufArch(gguf_gpt_oss.GGUF_ARCH, "gpt_oss", config_keys=_GPT_OSS_KEYS,
                 required_keys=(*_REQUIRED_KEYS, "attention.sliding_window"),
                 tensors=(*gguf_gpt_oss.TOP_TENSORS,
                          *((f"blk.{{n}}.{g}", f"model.layers.{{n}}.{h}") for g, h in gguf_gpt_oss.LAYER_TENSORS)),
                 extra=gguf_gpt_oss.config_fields, experts="mxfp4"),
    )
}


def arch_of(gguf: GgufFile) -> GgufArch:
    name = gguf.architecture
    row = ARCHS.get(name)
    if row is None:
        raise CheckpointError(
            f"{gguf.path}: general.architecture: unsupported {name!r}; supported: {', '.join(sorted(ARCHS))}"
        )
    return row


def tensor_names(gguf: GgufFile, row: GgufArch) -> dict[str, str]:
    """transformers name -> GGUF name, for the file's tensors the row maps (experts excluded)."""
    layers = int(gguf.get(f"{row.gguf_name}.block_count"))
    names: dict[str, str] = {}
    for ours, theirs in row.tensors:
        for n in range(layers) if "{n}" in ours else (None,):
            gguf_name = ours.format(n=n)
            if gguf.has_tensor(gguf_name):
                names[theirs.format(n=n)] = gguf_name
    return names


def hf_config(gguf: GgufFile) -> dict[str, Any]:
    """The `config.json` dict the file's metadata describes (`ModelConfig.from_hf_dict` takes it)."""
    row = arch_of(gguf)
    prefix = f"{row.gguf_name}."
    for key in row.required_keys:
        gguf.get(prefix + key)  # a missing key: CheckpointError naming it
    raw: dict[str, Any] = {"model_type": row.arch, **row.fixed}
    for hf_field, key in row.config_keys.items():
        if gguf.has(prefix + key):
            raw[hf_field] = gguf.get(prefix + key)
    raw.update(row.extra(gguf, prefix, int(raw["num_hidden_layers"])))
    _, _, embed_shape = gguf.tensor("token_embd.weight")
    raw["vocab_size"] = int(gguf.get(prefix + "vocab_size", embed_shape[0]))
    raw["tie_word_embeddings"] = not gguf.has_tensor("output.weight")
    raw["attention_bias"] = gguf.has_tensor("blk.0.attn_q.bias")
    layers = int(raw["num_hidden_layers"])
    raw["mlp_only_layers"] = [n for n in range(layers) if not gguf.has_tensor(f"blk.{n}.ffn_gate_inp.weight")]
    for hf_field, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if gguf.has(f"tokenizer.ggml.{key}"):
            raw[hf_field] = int(gguf.get(f"tokenizer.ggml.{key}"))
    return raw
