"""The hybrid Qwen families' part of synthetic checkpoints (loader/synth.py): their config.json
fields and their layer tensors, as transformers saves qwen3_next, qwen3_5_moe_text and
qwen3_5_moe models (experts per expert, Gated DeltaNet layers with qwen3_next's grouped
in_proj_qkvz/in_proj_ba or qwen3_5's split in_proj_qkv/z/b/a, gated attention's q_proj holding
each head's query and gate).

qwen3_5_moe is the vision-language layout: the text config nested in `text_config` beside a
`vision_config`, the text model's tensors under `model.language_model.`. Only the text model's
tensors are written: the engine reads no other (a vision tower's weights would only fill the
directory), so transformers loading such a checkpoint initialises `model.visual.*` itself.

RMSNorm weights are drawn near 0, as these families store them zero-centred (the norm scales by
1 + w), but the DeltaNet's output norm's near 1 (it scales by w).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from freetoken.loader.presets import Shape

ARCHITECTURES = {
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}
A_LOG_STD = 0.5  # log decay rates spread around 1
TEXT_MODEL = "model.language_model."


def text_config_fields(shape: Shape) -> dict[str, Any]:
    """The fields the text model's config has beyond the ones every family shares."""
    la = shape.linear_attention
    fields: dict[str, Any] = {
        "attention_bias": False,
        "head_dim": shape.head_dim,
        "layer_types": list(shape.layer_types),
        "linear_conv_kernel_dim": la.conv_width,
        "linear_key_head_dim": la.key_dim,
        "linear_num_key_heads": la.key_heads,
        "linear_num_value_heads": la.value_heads,
        "linear_value_head_dim": la.value_dim,
        "moe_intermediate_size": shape.moe_intermediate_size,
        "num_experts": shape.num_experts,
        "partial_rotary_factor": shape.partial_rotary_factor,
        "rope_parameters": {"partial_rotary_factor": shape.partial_rotary_factor, "rope_theta": shape.rope_theta,
                            "rope_type": "default"},
        "shared_expert_intermediate_size": shape.shared_expert_intermediate_size,
    }
    if shape.arch == "qwen3_next":
        fields.update(decoder_sparse_step=1, intermediate_size=shape.dense_intermediate_size, mlp_only_layers=[],
                      norm_topk_prob=shape.norm_topk_prob)
    return fields


def nest_text_config(config: dict[str, Any], shape: Shape) -> dict[str, Any]:
    """qwen3_5_moe's config.json around its text model's `config`."""
    text = {**config, "model_type": "qwen3_5_moe_text"}
    for name in ("architectures", "dtype", "torch_dtype"):
        text.pop(name, None)
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
              "model_type": "qwen3_5_moe_vision", "out_hidden_size": shape.hidden_size}
    return {"architectures": config["architectures"], "dtype": config["dtype"], "model_type": "qwen3_5_moe",
            "text_config": text, "tie_word_embeddings": config["tie_word_embeddings"], "vision_config": vision}


def layer_specs(shape: Shape, layer: int, prefix: str, spec: Callable[..., Any], norm_std: float,
                router_std: float) -> Iterator[Any]:
    """One layer's tensors after its input norm: spec(name, shape, kind, std) builds each TensorSpec."""
    h, hd, nh, nkv, la = shape.hidden_size, shape.head_dim, shape.num_heads, shape.num_kv_heads, shape.linear_attention

    def proj(name: str, out_f: int, in_f: int) -> Any:
        return spec(name, (out_f, in_f), "normal", 1.0 / math.sqrt(in_f))

    if shape.layer_types[layer] == "linear_attention":
        a = prefix + "linear_attn."
        keys, values = la.key_heads * la.key_dim, la.value_heads * la.value_dim
        yield spec(a + "A_log", (la.value_heads,), "normal", A_LOG_STD)
        yield spec(a + "conv1d.weight", (la.conv_channels, 1, la.conv_width), "normal", 1.0 / math.sqrt(la.conv_width))
        yield spec(a + "dt_bias", (la.value_heads,), "normal", norm_std)
        if shape.arch == "qwen3_next":
            yield proj(a + "in_proj_ba.weight", 2 * la.value_heads, h)
            yield proj(a + "in_proj_qkvz.weight", 2 * keys + 2 * values, h)
        else:
            yield proj(a + "in_proj_a.weight", la.value_heads, h)
            yield proj(a + "in_proj_b.weight", la.value_heads, h)
            yield proj(a + "in_proj_qkv.weight", 2 * keys + values, h)
            yield proj(a + "in_proj_z.weight", values, h)
        yield spec(a + "norm.weight", (la.value_dim,), "norm")
        yield proj(a + "out_proj.weight", h, values)
    else:
        a = prefix + "self_attn."
        yield spec(a + "k_norm.weight", (hd,), "normal", norm_std)
        yield proj(a + "k_proj.weight", nkv * hd, h)
        yield proj(a + "o_proj.weight", h, nh * hd)
        yield spec(a + "q_norm.weight", (hd,), "normal", norm_std)
        yield proj(a + "q_proj.weight", 2 * nh * hd, h)  # each head's query, then its gate
        yield proj(a + "v_proj.weight", nkv * hd, h)
    yield spec(prefix + "post_attention_layernorm.weight", (h,), "normal", norm_std)
    m, inter, si = prefix + "mlp.", shape.moe_intermediate_size, shape.shared_expert_intermediate_size
    yield spec(m + "gate.weight", (shape.num_experts, h), "normal", router_std)
    for e in range(shape.num_experts):
        yield proj(f"{m}experts.{e}.gate_proj.weight", inter, h)
        yield proj(f"{m}experts.{e}.up_proj.weight", inter, h)
        yield proj(f"{m}experts.{e}.down_proj.weight", h, inter)
    yield proj(m + "shared_expert.gate_proj.weight", si, h)
    yield proj(m + "shared_expert.up_proj.weight", si, h)
    yield proj(m + "shared_expert.down_proj.weight", h, si)
    yield spec(m + "shared_expert_gate.weight", (1, h), "normal", 1.0 / math.sqrt(h))
