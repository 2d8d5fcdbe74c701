"""Which of a model's layers mix tokens by full attention (and so hold KV pages) and which by
linear attention (and so hold a recurrent state): `layer_types` in the hybrid Qwen families,
every layer full attention in the others. The KV pool and the state pool each index only their
own layers, in order."""

from __future__ import annotations

from freetoken.config import ModelConfig


def attention_layers(config: ModelConfig) -> list[int]:
    """The layers with KV pages, in order: a layer's index in the KV pool is its place here."""
    if not config.layer_types:
        return list(range(config.num_layers))
    return [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]


def linear_layers(config: ModelConfig) -> list[int]:
    """The layers with a recurrent state, in order: a layer's index in the state pool is its place here."""
    return [i for i, kind in enumerate(config.layer_types) if kind == "linear_attention"]
