"""The supported model families, one file each, by their config.json "model_type"."""

from __future__ import annotations

from freetoken.config import ModelConfig
from freetoken.errors import CheckpointError
from freetoken.models.families.gpt_oss import GPT_OSS
from freetoken.models.families.mixtral import MIXTRAL
from freetoken.models.families.olmoe import OLMOE
from freetoken.models.families.qwen2_moe import QWEN2_MOE
from freetoken.models.families.qwen3_5 import QWEN3_5_MOE, QWEN3_5_MOE_TEXT, QWEN3_NEXT
from freetoken.models.families.qwen3_moe import QWEN3_MOE
from freetoken.models.family import Family

FAMILIES: dict[str, Family] = {
    family.arch: family
    for family in (QWEN3_MOE, QWEN2_MOE, OLMOE, MIXTRAL, GPT_OSS, QWEN3_NEXT, QWEN3_5_MOE_TEXT, QWEN3_5_MOE)
}


def family_of(config: ModelConfig) -> Family:
    try:
        return FAMILIES[config.arch]
    except KeyError:
        raise CheckpointError(f"no family for model_type {config.arch!r}") from None
