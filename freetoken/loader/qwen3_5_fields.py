"""The config.json fields of the hybrid Qwen families (qwen3_next, qwen3_5_moe_text, and
qwen3_5_moe, whose text model's fields sit in `text_config` beside a `vision_config`), as
ModelConfig fields: which layers are Gated DeltaNet linear attention and which gated full
attention (`layer_types`, or `full_attention_interval`), the linear layers' sizes, the share of
head_dim the rotary turns (`partial_rotary_factor`, at the top level or in `rope_parameters`).
Every layer of these families has the output-gated attention, per-head q/k norms and RMSNorms
whose weights are stored zero-centred (the norm scales by 1 + w).
"""

from __future__ import annotations

from typing import Any

import msgspec

from freetoken.loader.json_fields import JsonFields

HYBRID_ARCHS = ("qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")
LAYER_TYPES = ("linear_attention", "full_attention")
# the names older configs of hybrid models gave the two kinds of layer (transformers reads them so)
_LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "conv": "linear_attention", "attention": "full_attention"}


class LinearAttentionShape(msgspec.Struct, frozen=True, kw_only=True):
    """The sizes of a Gated DeltaNet layer: HK key heads of DK, HV value heads of DV (HV a
    multiple of HK: each key head serves HV/HK value heads), a depthwise causal conv of width W
    over the q/k/v channels."""

    key_heads: int  # HK
    value_heads: int  # HV
    key_dim: int  # DK
    value_dim: int  # DV
    conv_width: int  # W

    @property
    def conv_channels(self) -> int:
        """C: q and k (HK*DK each) and v (HV*DV), the channels the conv runs over."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


def text_config(f: JsonFields) -> JsonFields:
    """qwen3_5_moe's text model fields: its `text_config`, named as a qwen3_5_moe_text config is
    (the vision tower's `vision_config` is not read: the engine generates text)."""
    text = f.object("text_config")
    if text is None:
        raise f.error("text_config", "missing (a qwen3_5_moe config keeps its text model's fields there)")
    raw = dict(text.raw)
    kind = raw.get("model_type")
    if kind is not None and kind != "qwen3_5_moe_text":
        raise text.error("model_type", f"expected 'qwen3_5_moe_text', got {kind!r}")
    # fields transformers reads from the outer config when the text config lacks them
    for name in ("tie_word_embeddings", "dtype", "torch_dtype"):
        if name not in raw and name in f.raw:
            raw[name] = f.raw[name]
    raw["model_type"] = "qwen3_5_moe"
    return JsonFields(raw, text.source)


def layer_types(f: JsonFields, num_layers: int) -> tuple[str, ...]:
    types = f.raw.get("layer_types")
    if types is None:  # transformers' default: every `full_attention_interval`-th layer is full attention
        interval = f.integer("full_attention_interval", default=4)
        return tuple(LAYER_TYPES[(i + 1) % interval == 0] for i in range(num_layers))
    if not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        raise f.error("layer_types", f"expected a list of {num_layers} strings, got {str(types)[:80]}")
    types = [_LEGACY_LAYER_TYPES.get(t, t) for t in types]
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        raise f.error("layer_types", f"unknown layer type {unknown[0]!r}; expected {' or '.join(LAYER_TYPES)}")
    if len(types) != num_layers:
        raise f.error("layer_types", f"lists {len(types)} layers, but num_hidden_layers is {num_layers}")
    if "full_attention" not in types:
        raise f.error("layer_types", "no full_attention layer: freetoken's KV pool needs at least one")
    return tuple(types)


def hybrid_fields(f: JsonFields, num_layers: int, head_dim: int) -> dict[str, Any]:
    """The ModelConfig fields only the hybrid families have (f: the text model's fields)."""
    key_heads, value_heads = f.integer("linear_num_key_heads"), f.integer("linear_num_value_heads")
    if value_heads % key_heads:
        raise f.error("linear_num_key_heads", f"{key_heads} does not divide linear_num_value_heads ({value_heads})")
    linear = LinearAttentionShape(
        key_heads=key_heads, value_heads=value_heads, key_dim=f.integer("linear_key_head_dim"),
        value_dim=f.integer("linear_value_head_dim"),
        conv_width=f.integer("linear_conv_kernel_dim", minimum=2, default=4))
    if not f.flag("attn_output_gate", True):  # (transformers' classes gate every full-attention layer)
        raise f.error("attn_output_gate", "false: these families' attention without its output gate is not supported")
    rope = f.object("rope_parameters", "rope_scaling")
    factor = f.positive_number("partial_rotary_factor", 0.25)  # transformers' default for these families
    if rope is not None:
        factor = rope.positive_number("partial_rotary_factor", factor)
    rotary_dim = int(head_dim * factor)
    if factor > 1 or rotary_dim < 2 or rotary_dim % 2:
        raise f.error("partial_rotary_factor", f"{factor} of head_dim {head_dim} gives {rotary_dim} rotary "
                      "dimensions; expected an even number in 2..head_dim")
    return dict(layer_types=layer_types(f, num_layers), linear_attention=linear, partial_rotary_factor=factor,
                attention_output_gate=True, zero_centred_norms=True)
