"""gpt-oss's part of synthetic checkpoints (loader/synth.py): its config.json fields and its
layer tensors, as transformers saves a gpt-oss model with bf16 experts (fused expert tensors
gate_up_proj [E, H, 2I] with gate and up in the even and odd columns, down_proj [E, I, H], their
biases; a biased router; q/k/v/o biases and one attention sink per head).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from freetoken.loader.presets import Shape

YARN_FACTOR = 32.0  # the real models': 4k positions trained, 128k served
SINK_STD = 1.0  # sinks at the scale of attention logits, so they take a visible share
GATE_UP_GAIN = 3.0  # gate/up a little hotter than 1/sqrt(H), so the clamped SwiGLU's limit binds on some values


def config_fields(shape: Shape) -> dict[str, Any]:
    """The fields gpt-oss's config.json has beyond the ones every family shares."""
    return {
        "attention_bias": True,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.moe_intermediate_size,
        # transformers' pattern: even layers slide, odd layers attend to everything
        "layer_types": ["full_attention" if i % 2 else "sliding_attention" for i in range(shape.num_layers)],
        "num_local_experts": shape.num_experts,
        "rope_parameters": {
            "beta_fast": 32.0, "beta_slow": 1.0, "factor": YARN_FACTOR, "rope_theta": shape.rope_theta,
            "original_max_position_embeddings": int(shape.max_position_embeddings / YARN_FACTOR),
            "rope_type": "yarn", "truncate": False,
        },
        "sliding_window": shape.sliding_window,
    }


def layer_specs(shape: Shape, prefix: str, spec: Callable[..., Any], bias_std: float,
                router_std: float) -> Iterator[Any]:
    """One layer's tensors after its input norm and before its post-attention norm's successor:
    spec(name, shape, kind, std) builds each TensorSpec."""
    h, hd, nh, nkv = shape.hidden_size, shape.head_dim, shape.num_heads, shape.num_kv_heads
    E, inter = shape.num_experts, shape.moe_intermediate_size
    a = prefix + "self_attn."
    for name, rows in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
        yield spec(f"{a}{name}.weight", (rows, h), "normal", 1.0 / math.sqrt(h))
        yield spec(f"{a}{name}.bias", (rows,), "normal", bias_std)
    yield spec(a + "o_proj.weight", (h, nh * hd), "normal", 1.0 / math.sqrt(nh * hd))
    yield spec(a + "o_proj.bias", (h,), "normal", bias_std)
    yield spec(a + "sinks", (nh,), "normal", SINK_STD)
    yield spec(prefix + "post_attention_layernorm.weight", (h,), "norm")
    m = prefix + "mlp."
    yield spec(m + "router.weight", (E, h), "normal", router_std)
    yield spec(m + "router.bias", (E,), "normal", bias_std)
    yield spec(m + "experts.gate_up_proj", (E, h, 2 * inter), "normal", GATE_UP_GAIN / math.sqrt(h))
    yield spec(m + "experts.gate_up_proj_bias", (E, 2 * inter), "normal", bias_std)
    yield spec(m + "experts.down_proj", (E, inter, h), "normal", 1.0 / math.sqrt(inter))
    yield spec(m + "experts.down_proj_bias", (E, h), "normal", bias_std)
