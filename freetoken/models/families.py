"""How each supported family names its tensors in a Hugging Face checkpoint.

The math of the four families differs only in what ModelConfig already records (q/k norm
kind, qkv bias, router renormalisation and precision, shared expert); what the loader needs
per family is where each tensor lives. One table, one row per family.
"""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.config import ModelConfig
from freetoken.errors import CheckpointError


@dataclass(frozen=True)
class FamilyLayout:
    arch: str
    hf_architecture: str  # config.json "architectures"[0]
    moe_prefix: str  # module holding router + experts, under model.layers.N.
    expert_names: tuple[str, str, str]  # (gate, up, down) under <moe_prefix>.experts.<e>.


FAMILIES: dict[str, FamilyLayout] = {
    "qwen3_moe": FamilyLayout("qwen3_moe", "Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen2_moe": FamilyLayout("qwen2_moe", "Qwen2MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "olmoe": FamilyLayout("olmoe", "OlmoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": FamilyLayout("mixtral", "MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2")),
}


def family_of(config: ModelConfig) -> FamilyLayout:
    try:
        return FAMILIES[config.arch]
    except KeyError:
        raise CheckpointError(f"no tensor layout for model_type {config.arch!r}") from None


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def expert_tensor_names(family: FamilyLayout, layer: int, expert: int) -> tuple[str, str, str]:
    base = f"{layer_prefix(layer)}{family.moe_prefix}.experts.{expert}."
    return tuple(f"{base}{name}.weight" for name in family.expert_names)  # type: ignore[return-value]


def fused_expert_tensor_names(family: FamilyLayout, layer: int) -> tuple[str, str]:
    """The fused layout transformers 5 keeps in memory: experts.gate_up_proj [E,2I,H], experts.down_proj."""
    base = f"{layer_prefix(layer)}mlp.experts."
    return f"{base}gate_up_proj", f"{base}down_proj"


def router_tensor_name(family: FamilyLayout, layer: int) -> str:
    return f"{layer_prefix(layer)}{family.moe_prefix}.gate.weight"
