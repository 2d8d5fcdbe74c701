"""What a model family is to the engine: where its Hugging Face checkpoint keeps each tensor, and
the blocks its decoder is composed of. Each family is one file in models/families/, which sets
only what differs from the shared blocks; a new family is a new file there.
"""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.models.attention import Attention
from freetoken.models.moe_layer import MoELayer
from freetoken.models.router import Router


@dataclass(frozen=True)
class Family:
    arch: str  # config.json "model_type"
    hf_architecture: str  # config.json "architectures"[0]
    moe_prefix: str  # module holding router + experts, under model.layers.N.
    expert_names: tuple[str, str, str]  # (gate, up, down) under <moe_prefix>.experts.<e>. (per-expert layouts)
    attention: type[Attention] = Attention
    router: type[Router] = Router
    moe_layer: type[MoELayer] = MoELayer
    router_name: str = "gate"  # the router's module under <moe_prefix>.
    linear_attention: type | None = None  # the linear-attention block of layer_types' linear layers (qwen3_5)
    # Whether its RMSNorms multiply by the weight in fp32 and round once (gpt_oss), rather than
    # round the normed x first and multiply in the activation dtype (reference/norms.py).
    norms_rounded_once: bool = False


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def expert_tensor_names(family: Family, layer: int, expert: int) -> tuple[str, str, str]:
    base = f"{layer_prefix(layer)}{family.moe_prefix}.experts.{expert}."
    return tuple(f"{base}{name}.weight" for name in family.expert_names)  # type: ignore[return-value]


def fused_expert_tensor_names(family: Family, layer: int) -> tuple[str, str]:
    """The fused layout transformers 5 keeps in memory: experts.gate_up_proj [E,2I,H], experts.down_proj."""
    base = f"{layer_prefix(layer)}mlp.experts."
    return f"{base}gate_up_proj", f"{base}down_proj"


def router_tensor_name(family: Family, layer: int, part: str = "weight") -> str:
    """part: "weight", or "bias" where the router has one (gpt_oss)."""
    return f"{layer_prefix(layer)}{family.moe_prefix}.{family.router_name}.{part}"
