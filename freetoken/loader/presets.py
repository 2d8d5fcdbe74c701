"""Preset model shapes for synthetic checkpoints, per architecture.

A preset fixes the sizes; each family then lays them out its own way (Mixtral has no
`moe_intermediate_size`, OLMoE has no free `head_dim`, qwen2_moe adds a shared expert).

| preset        | layers | hidden | heads/kv | head_dim | experts | top-k | expert inter | vocab  |
|---------------|--------|--------|----------|----------|---------|-------|--------------|--------|
| tiny          | 2      | 64     | 4/2      | 16 (32*) | 8       | 2     | 48           | 1024   |
| tiny-gguf     | 2      | 256    | 4/2      | 64       | 8       | 2     | 256          | 1024   |
| demo          | 4      | 128    | 4/2      | 32       | 16      | 4     | 96           | 1024   |
| small         | 4      | 512    | 8/4      | 64       | 32      | 4     | 384          | 1024   |
| qwen3-30b-a3b | 48     | 2048   | 32/4 (**)| 128      | 128     | 8     | 768          | 151936 |
| gpt-oss-20b   | 24     | 2880   | 64/8     | 64       | 32      | 4     | 2880         | 201088 |
| gpt-oss-120b  | 36     | 2880   | 64/8     | 64       | 128     | 4     | 2880         | 201088 |
| tiny (hybrid) | 4      | 40     | 3/1      | 16       | 6       | 2     | 24           | 1024   |
| tiny-gguf (hybrid) | 4 | 256    | 4/2      | 64       | 8       | 2     | 256          | 1024   |
| qwen3.6-35b-a3b | 40   | 2048   | 16/2     | 256      | 256     | 8     | 512          | 248320 |

(*) qwen3_moe decouples head_dim from hidden/heads, as the real model does.
(**) the other families tie head_dim to hidden/heads, so they use 16 heads of 128.
gpt_oss decouples head_dim as qwen3_moe does; its sliding window is 16 in tiny and tiny-gguf,
32 in demo and 128 (the real models') elsewhere. The gpt-oss presets are gpt_oss's only.
`tiny-gguf` is the smallest shape whose rows are whole 256-element K-quant blocks, so
tests can write Q4_K/Q5_K/Q6_K GGUFs. qwen2_moe's shared expert is 80 / 256 / 160 / 1280 /
3072 wide. Sizes of the bf16 weights: tiny under 1 MB, tiny-gguf 8 MB, demo 6 MB, small
160-175 MB, qwen3-30b-a3b about 61 GB (58 GB of it experts).
The hybrid families (qwen3_next, qwen3_5_moe_text, qwen3_5_moe) take only `tiny`, `tiny-gguf` and
`qwen3.6-35b-a3b`, at 3 linear-attention layers to each full-attention one (so `--layers` must be
a multiple of 4); tiny's linear layers have 2 key heads of 6 and 6 value heads of 5, tiny-gguf's
2 of 64 and 4 of 64 (llama.cpp's DeltaNet takes equal key and value head sizes, and every row is
whole 256-element K-quant blocks), the 35B's 16 of 128 and 32 of 128; all have a shared expert
(36 / 256 / 512 wide) and a rotary over a quarter of each head. The tokenizer covers the low
1000 ids; the model vocabulary is padded above it, as real checkpoints pad theirs (the output
rows of padding ids are zero).
"""

from __future__ import annotations

import msgspec

from freetoken.config import SUPPORTED_ARCHS
from freetoken.loader.qwen3_5_fields import HYBRID_ARCHS, LAYER_TYPES, LinearAttentionShape

PRESET_NAMES = ("tiny", "tiny-gguf", "small", "qwen3-30b-a3b", "demo", "gpt-oss-20b", "gpt-oss-120b",
                "qwen3.6-35b-a3b")
GPT_OSS_PRESETS = ("gpt-oss-20b", "gpt-oss-120b")
FULL_ATTENTION_INTERVAL = 4  # the hybrid families' 3:1 pattern: every fourth layer is full attention

TOKENIZER_VOCAB = 1000  # tokens in the built tokenizer, for every preset


class Shape(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a synthetic checkpoint's config needs, already in one family's layout."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    moe_intermediate_size: int
    dense_intermediate_size: int  # qwen families' dense MLP size (unused unless dense layers)
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0  # qwen2_moe only
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tokenizer_vocab_size: int = TOKENIZER_VOCAB
    sliding_window: int = 128  # gpt_oss's sliding layers (the other families have none)
    # the hybrid families (qwen3_next, qwen3_5_moe): linear-attention layers among full ones
    layer_types: tuple[str, ...] = ()
    linear_attention: LinearAttentionShape | None = None
    partial_rotary_factor: float = 1.0


# Family defaults that are not sizes.
_FAMILY = {
    "qwen3_moe": {"norm_topk_prob": True, "rms_norm_eps": 1e-6},
    "mixtral": {"norm_topk_prob": True, "rms_norm_eps": 1e-5},
    "olmoe": {"norm_topk_prob": False, "rms_norm_eps": 1e-5},
    "qwen2_moe": {"norm_topk_prob": False, "rms_norm_eps": 1e-6},
    "gpt_oss": {"norm_topk_prob": False, "rms_norm_eps": 1e-5},
    **{arch: {"norm_topk_prob": True, "rms_norm_eps": 1e-6} for arch in HYBRID_ARCHS},
}

# The hybrid families' own shapes (only these presets are theirs): `tiny` of odd sizes, and the
# Qwen3.6-35B-A3B shape (transformers' Qwen3_5MoeTextConfig defaults, which are that model's sizes).
_HYBRID_PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=1024, hidden_size=40, num_layers=4, num_heads=3, head_dim=16, num_kv_heads=1,
        moe_intermediate_size=24, dense_intermediate_size=56, num_experts=6, top_k=2,
        shared_expert_intermediate_size=36, rope_theta=10000.0, max_position_embeddings=4096,
        linear_attention=LinearAttentionShape(key_heads=2, value_heads=6, key_dim=6, value_dim=5, conv_width=4),
    ),
    "tiny-gguf": dict(
        vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4, head_dim=64, num_kv_heads=2,
        moe_intermediate_size=256, dense_intermediate_size=512, num_experts=8, top_k=2,
        shared_expert_intermediate_size=256, rope_theta=10000.0, max_position_embeddings=4096,
        linear_attention=LinearAttentionShape(key_heads=2, value_heads=4, key_dim=64, value_dim=64, conv_width=4),
    ),
    "qwen3.6-35b-a3b": dict(
        vocab_size=248320, hidden_size=2048, num_layers=40, num_heads=16, head_dim=256, num_kv_heads=2,
        moe_intermediate_size=512, dense_intermediate_size=5632, num_experts=256, top_k=8,
        shared_expert_intermediate_size=512, rope_theta=10000.0, max_position_embeddings=262144,
        linear_attention=LinearAttentionShape(key_heads=16, value_heads=32, key_dim=128, value_dim=128,
                                              conv_width=4),
    ),
}

# preset -> sizes. `free_heads` = (heads, head_dim) for qwen3_moe, whose head_dim is free;
# `tied_heads` = (heads, head_dim) with heads * head_dim == hidden for the other families.
_PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=1024,
        hidden_size=64,
        num_layers=2,
        free_heads=(4, 32),
        tied_heads=(4, 16),
        num_kv_heads=2,
        moe_intermediate_size=48,
        dense_intermediate_size=96,
        num_experts=8,
        top_k=2,
        shared_expert_intermediate_size=80,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        sliding_window=16,
    ),
    "tiny-gguf": dict(
        vocab_size=1024,
        hidden_size=256,
        num_layers=2,
        free_heads=(4, 64),
        tied_heads=(4, 64),
        num_kv_heads=2,
        moe_intermediate_size=256,
        dense_intermediate_size=512,
        num_experts=8,
        top_k=2,
        shared_expert_intermediate_size=256,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        sliding_window=16,
    ),
    "demo": dict(
        vocab_size=1024,
        hidden_size=128,
        num_layers=4,
        free_heads=(4, 32),
        tied_heads=(4, 32),
        num_kv_heads=2,
        moe_intermediate_size=96,
        dense_intermediate_size=256,
        num_experts=16,
        top_k=4,
        shared_expert_intermediate_size=160,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        sliding_window=32,
    ),
    "small": dict(
        vocab_size=1024,
        hidden_size=512,
        num_layers=4,
        free_heads=(8, 64),
        tied_heads=(8, 64),
        num_kv_heads=4,
        moe_intermediate_size=384,
        dense_intermediate_size=1536,
        num_experts=32,
        top_k=4,
        shared_expert_intermediate_size=1280,
        rope_theta=1_000_000.0,
        max_position_embeddings=8192,
    ),
    "qwen3-30b-a3b": dict(
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        free_heads=(32, 128),
        tied_heads=(16, 128),
        num_kv_heads=4,
        moe_intermediate_size=768,
        dense_intermediate_size=6144,
        num_experts=128,
        top_k=8,
        shared_expert_intermediate_size=3072,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
    ),
    **{
        name: dict(
            vocab_size=201088,
            hidden_size=2880,
            num_layers=layers,
            free_heads=(64, 64),
            tied_heads=(64, 64),
            num_kv_heads=8,
            moe_intermediate_size=2880,
            dense_intermediate_size=2880,
            num_experts=experts,
            top_k=4,
            shared_expert_intermediate_size=0,
            rope_theta=150000.0,
            max_position_embeddings=131072,
        )
        for name, layers, experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128))
    },
}


def preset_shape(
    arch: str,
    preset: str,
    *,
    layers: int | None = None,
    experts: int | None = None,
    top_k: int | None = None,
    norm_topk_prob: bool | None = None,
) -> Shape:
    """The shape of `preset` in `arch`'s layout, with optional overrides. ValueError on an
    unknown arch/preset or an impossible override."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of: {', '.join(SUPPORTED_ARCHS)}")
    if arch in HYBRID_ARCHS:
        if norm_topk_prob is not None:
            raise ValueError(f"{arch} renormalises its top-k weights; norm_topk_prob cannot be set")
        return _hybrid_shape(arch, preset, layers, experts, top_k)
    if preset in _HYBRID_PRESETS and preset not in _PRESETS:
        raise ValueError(f"preset {preset!r} is the hybrid families' shape ({', '.join(HYBRID_ARCHS)}); "
                         f"not for arch {arch!r}")
    if preset not in _PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESET_NAMES)}")
    if preset in GPT_OSS_PRESETS and arch != "gpt_oss":
        raise ValueError(f"preset {preset!r} is gpt_oss's shape; not for arch {arch!r}")
    p = _PRESETS[preset]
    fam = _FAMILY[arch]
    heads, head_dim = p["free_heads"] if arch in ("qwen3_moe", "gpt_oss") else p["tied_heads"]
    num_layers = p["num_layers"] if layers is None else layers
    num_experts = p["num_experts"] if experts is None else experts
    k = p["top_k"] if top_k is None else top_k
    if num_layers < 1:
        raise ValueError(f"layers must be >= 1, got {num_layers}")
    if num_experts < 1:
        raise ValueError(f"experts must be >= 1, got {num_experts}")
    if not 1 <= k <= num_experts:
        raise ValueError(f"top-k must be in [1, experts={num_experts}], got {k}")
    if norm_topk_prob is not None and arch == "mixtral":
        raise ValueError("mixtral always renormalises its top-k weights; norm_topk_prob cannot be set")
    return Shape(
        arch=arch,
        vocab_size=p["vocab_size"],
        hidden_size=p["hidden_size"],
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=p["num_kv_heads"],
        head_dim=head_dim,
        moe_intermediate_size=p["moe_intermediate_size"],
        dense_intermediate_size=p["dense_intermediate_size"],
        num_experts=num_experts,
        top_k=k,
        norm_topk_prob=fam["norm_topk_prob"] if norm_topk_prob is None else bool(norm_topk_prob),
        shared_expert_intermediate_size=p["shared_expert_intermediate_size"] if arch == "qwen2_moe" else 0,
        rms_norm_eps=fam["rms_norm_eps"],
        rope_theta=p["rope_theta"],
        max_position_embeddings=p["max_position_embeddings"],
        sliding_window=p.get("sliding_window", 128),
    )


def _hybrid_shape(arch: str, preset: str, layers: int | None, experts: int | None, top_k: int | None) -> Shape:
    if preset not in _HYBRID_PRESETS:
        raise ValueError(f"arch {arch!r} has the presets {', '.join(_HYBRID_PRESETS)}, not {preset!r}")
    p = dict(_HYBRID_PRESETS[preset])
    preset_layers, preset_experts, preset_k = p.pop("num_layers"), p.pop("num_experts"), p.pop("top_k")
    num_layers = preset_layers if layers is None else layers
    if num_layers < 1 or num_layers % FULL_ATTENTION_INTERVAL:
        raise ValueError(f"layers must be a positive multiple of {FULL_ATTENTION_INTERVAL} for arch {arch!r} "
                         f"(three linear-attention layers to each full-attention one), got {num_layers}")
    num_experts = preset_experts if experts is None else experts
    k = preset_k if top_k is None else top_k
    if not 1 <= k <= num_experts:
        raise ValueError(f"top-k must be in [1, experts={num_experts}], got {k}")
    types = tuple(LAYER_TYPES[(i + 1) % FULL_ATTENTION_INTERVAL == 0] for i in range(num_layers))
    return Shape(arch=arch, num_layers=num_layers, num_experts=num_experts, top_k=k, layer_types=types,
                 partial_rotary_factor=0.25, **_FAMILY[arch], **p)
