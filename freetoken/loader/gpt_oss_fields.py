"""The config.json fields only gpt-oss has, as ModelConfig fields: which layers attend over a
sliding window (`layer_types`, `sliding_window`), attention sinks, the biased router that takes
its softmax over the top-k logits, and biased experts with the clamped SwiGLU. Experts stored as
MXFP4 (`quantization_config.quant_method: mxfp4`, as the released checkpoints are) are read and
dequantized by the loader; any other quantization method is refused.
"""

from __future__ import annotations

from typing import Any

from freetoken.loader.json_fields import JsonFields
from freetoken.loader.rope_scaling import YarnRope, read_yarn

LAYER_TYPES = ("sliding_attention", "full_attention")


def gpt_oss_fields(f: JsonFields, num_layers: int, yarn: YarnRope | None) -> dict[str, Any]:
    """yarn: the config's own YaRN parameters (None: none given, and transformers' defaults for
    gpt-oss apply, unless the config names the default rotary)."""
    quant = f.object("quantization_config")
    if quant is not None and (method := quant.string("quant_method", "")) != "mxfp4":
        raise quant.error("quant_method", f"{method!r} is not supported (gpt-oss loads bf16 or MXFP4 experts)")
    types = f.raw.get("layer_types")
    if types is None:  # transformers' default: even layers slide, odd layers see everything
        types = [LAYER_TYPES[i % 2] for i in range(num_layers)]
    if not (isinstance(types, list) and len(types) == num_layers and all(t in LAYER_TYPES for t in types)):
        raise f.error("layer_types", f"expected {num_layers} of {', '.join(map(repr, LAYER_TYPES))}, got {types!r}")
    sliding = tuple(t == "sliding_attention" for t in types)
    window = f.optional_integer("sliding_window", minimum=1) if "sliding_window" in f.raw else 128
    if any(sliding) and window is None:
        raise f.error("sliding_window", "layer_types has sliding_attention layers, but no window is given")
    if yarn is None and f.object("rope_parameters", "rope_scaling") is None:
        defaults = {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                    "original_max_position_embeddings": 4096}
        yarn = read_yarn(JsonFields(defaults, f"{f.source}: rope_parameters (default)"), 4096)
    return dict(
        rope_scaling=yarn,
        sliding_window=window if any(sliding) else None,
        sliding_layers=sliding,
        attention_sinks=True,
        router_bias=True,
        router_softmax="top_k",
        expert_bias=True,
        expert_activation="clamped_swiglu",
    )
