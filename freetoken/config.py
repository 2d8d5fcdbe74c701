"""Typed configuration: the one place for every knob.

- ModelConfig: the architecture, normalised from a Hugging Face `config.json` of any supported
  family (field names differ between families; the engine sees one shape).
- SamplingParams: what a request asks of the sampler; validated before it enters the engine.
- EngineConfig (engine_config.py): how the engine runs, a tree of sub-configs.
- ServerConfig (server_config.py): where the server listens and what it lets through.
Both are re-exported here, with the tree's markers (config_tree.py), so every config is imported
from this module.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import msgspec

from freetoken.config_tree import DIAGNOSTICS, MOE_GROUP, cli_flag, no_flag
from freetoken.engine_config import (
    Device,
    DType,
    EngineConfig,
    GraphConfig,
    KernelConfig,
    KvConfig,
    MoeConfig,
    SchedulerConfig,
    TraceConfig,
)
from freetoken.errors import CheckpointError, RequestError
from freetoken.loader.gpt_oss_fields import gpt_oss_fields
from freetoken.loader.json_fields import JsonFields, read_json_object
from freetoken.loader.paths import checkpoint_file, is_gguf
from freetoken.loader.qwen3_5_fields import HYBRID_ARCHS, LinearAttentionShape, hybrid_fields, text_config
from freetoken.loader.rope_scaling import YarnRope, read_yarn
from freetoken.server_config import ServerConfig

__all__ = [
    "CHECKPOINT_DTYPES", "DIAGNOSTICS", "MOE_GROUP", "SUPPORTED_ARCHS", "DType", "Device", "EngineConfig",
    "GraphConfig", "KernelConfig", "KvConfig", "ModelConfig", "MoeConfig", "SamplingParams", "SchedulerConfig",
    "ServerConfig", "TraceConfig", "cli_flag", "no_flag",
]

SUPPORTED_ARCHS = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss", *HYBRID_ARCHS)
CHECKPOINT_DTYPES = ("bfloat16", "float16", "float32", "float64")  # what config.json's dtype may name

# How each family normalises q and k before RoPE: not at all, per head (Qwen3), or over the
# whole projection (OLMoE).
QKNorm = Literal["none", "head", "full"]


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP of non-sparse layers
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0  # qwen2_moe's sigmoid-gated shared expert
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    qkv_bias: bool = False
    o_bias: bool = False  # a bias on the attention's output projection too (attention_bias in qwen3_moe, olmoe)
    qk_norm: QKNorm = "none"
    clip_qkv: float | None = None
    tie_word_embeddings: bool = False
    sparse_layers: tuple[bool, ...] = ()  # per layer: MoE (True) or dense MLP (False)
    # Router: "softmax_topk" = softmax over all experts, then top-k (optionally renormalised).
    # Mixtral keeps its top-k weights in fp32 into the expert sum; the others cast to the
    # activation dtype first. Both are recorded so bf16 rounding points match the reference.
    router_weights_fp32: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # the attention window some layer has (see check_context)
    # gpt_oss (loader/gpt_oss_fields.py); the defaults are what the other families compute.
    sliding_layers: tuple[bool, ...] = ()  # per layer: attends over the last sliding_window positions only
    attention_sinks: bool = False  # a learned logit per head joins each attention softmax
    router_bias: bool = False  # (and biases on q/k/v/o: qkv_bias, o_bias)
    router_softmax: Literal["all", "top_k"] = "all"  # softmax over every expert, or over the top-k logits
    expert_bias: bool = False  # biases on the experts' gate/up and down projections
    expert_activation: Literal["swiglu", "clamped_swiglu"] = "swiglu"  # clamped: (up + 1) * glu, see reference/moe.py
    rope_scaling: YarnRope | None = None  # None: the default rotary
    # the hybrid Qwen families (loader/qwen3_5_fields.py); the defaults are what the others compute
    layer_types: tuple[str, ...] = ()  # per layer "linear_attention" or "full_attention"; (): every layer full
    linear_attention: LinearAttentionShape | None = None  # the Gated DeltaNet layers' sizes
    partial_rotary_factor: float = 1.0  # the share of head_dim the rotary turns (its first dims)
    attention_output_gate: bool = False  # q_proj gives each head a sigmoid gate on its output too
    zero_centred_norms: bool = False  # RMSNorm weights stored as w - 1: the norms scale by 1 + w

    @property
    def expert_bytes_bf16(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size * 2

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Normalise a family's `config.json`; CheckpointError names the field of any value that
        is missing, of the wrong type, out of range or inconsistent with the others."""
        f = JsonFields(raw, source)
        arch = raw.get("model_type")
        if arch == "qwen3_5_moe":  # a vision-language config: the text model's fields are in text_config
            f = text_config(f)
        if arch not in SUPPORTED_ARCHS:
            raise f.error("model_type", f"unsupported {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        for name in ("dtype", "torch_dtype"):
            dtype = f.string(name)
            if dtype is not None and dtype not in CHECKPOINT_DTYPES:
                raise f.error(name, f"unknown dtype {dtype!r}; expected one of {', '.join(CHECKPOINT_DTYPES)}")
        hidden = f.integer("hidden_size")
        heads = f.integer("num_attention_heads")
        kv_heads = f.integer("num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise f.error("num_key_value_heads", f"{kv_heads} does not divide num_attention_heads ({heads})")
        if f.present("head_dim") is None and hidden % heads and arch not in HYBRID_ARCHS:
            raise f.error("num_attention_heads", f"{heads} does not divide hidden_size ({hidden}), and no head_dim")
        head_dim = f.integer("head_dim", default=256 if arch in HYBRID_ARCHS else hidden // heads)  # (as transformers)
        layers = f.integer("num_hidden_layers")
        vocab = f.integer("vocab_size")
        rope_theta = f.positive_number("rope_theta", 150000.0 if arch == "gpt_oss" else 10000.0)
        rope, yarn = f.object("rope_parameters", "rope_scaling"), None
        if rope is not None:
            rope_type = rope.string("rope_type", rope.string("type", "default"))
            if rope_type not in ("default", "yarn"):
                raise rope.error("rope_type", f"{rope_type!r} is not supported yet (default RoPE or yarn)")
            rope_theta = rope.positive_number("rope_theta", rope_theta)
            if rope_type == "yarn":
                yarn = read_yarn(rope, f.integer("max_position_embeddings", default=4096))
        if arch == "mixtral":
            experts = f.integer("num_local_experts", "num_experts")
            moe_inter = f.integer("intermediate_size")
            dense_inter, norm_topk = moe_inter, True
        elif arch == "gpt_oss":  # the softmax over the top-k logits sums to one already
            experts, moe_inter = f.integer("num_local_experts", "num_experts"), f.integer("intermediate_size")
            dense_inter, norm_topk = moe_inter, False
        else:  # (qwen3_5's router always renormalises; qwen3_next's does by default)
            experts = f.integer("num_experts", "num_local_experts")
            moe_inter = f.integer("moe_intermediate_size", "intermediate_size")
            dense_inter = f.integer("intermediate_size", default=moe_inter)
            norm_topk = f.flag("norm_topk_prob", arch == "qwen3_next") or arch in HYBRID_ARCHS[1:]
        top_k = f.integer("num_experts_per_tok")
        if top_k > experts:
            raise f.error("num_experts_per_tok", f"{top_k} is more than the number of experts ({experts})")
        step = f.integer("decoder_sparse_step", default=1)
        dense_only = set(f.integers("mlp_only_layers"))
        if any(i >= layers for i in dense_only):
            raise f.error("mlp_only_layers", f"layer ids must be below num_hidden_layers ({layers})")
        if arch in ("qwen3_moe", "qwen2_moe", "qwen3_next"):
            sparse = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(layers))
        else:
            sparse = (True,) * layers
        special = {name: f.integers(name) for name in ("bos_token_id", "eos_token_id")}
        for name, ids in special.items():
            if any(i >= vocab for i in ids):
                raise f.error(name, f"{ids} is outside the vocabulary (vocab_size {vocab})")
        if len(special["bos_token_id"]) > 1:
            raise f.error("bos_token_id", f"expected one token id, got {special['bos_token_id']}")
        # qwen3_moe's and olmoe's attention_bias puts biases on q, k, v and o; Mixtral has none (its
        # transformers class ignores the field) and qwen2_moe biases q, k, v by its own qkv_bias.
        attention_bias = (arch in ("qwen3_moe", "olmoe", "gpt_oss", *HYBRID_ARCHS)
                          and f.flag("attention_bias", arch == "gpt_oss"))
        extra = (gpt_oss_fields(f, layers, yarn) if arch == "gpt_oss"
                 else {"sliding_window": _sliding_window(f, arch), "rope_scaling": yarn})
        if arch in HYBRID_ARCHS:
            extra.update(hybrid_fields(f, layers, head_dim))
        return cls(
            arch=arch, vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=dense_inter, moe_intermediate_size=moe_inter,
            num_experts=experts, top_k=top_k, norm_topk_prob=norm_topk,
            shared_expert_intermediate_size=f.integer("shared_expert_intermediate_size", minimum=0,
                                                      default=512 if arch in HYBRID_ARCHS else 0)
            if arch in ("qwen2_moe", *HYBRID_ARCHS) else 0,
            rms_norm_eps=f.positive_number("rms_norm_eps", 1e-6), rope_theta=rope_theta,
            max_position_embeddings=f.integer("max_position_embeddings", default=4096),
            qkv_bias=f.flag("qkv_bias", True) if arch == "qwen2_moe" else attention_bias,
            o_bias=attention_bias,
            qk_norm="head" if arch in ("qwen3_moe", *HYBRID_ARCHS) else "full" if arch == "olmoe" else "none",
            clip_qkv=f.positive_number("clip_qkv", None) if arch == "olmoe" else None,
            tie_word_embeddings=f.flag("tie_word_embeddings", False), sparse_layers=sparse,
            router_weights_fp32=arch == "mixtral",
            bos_token_id=special["bos_token_id"][0] if special["bos_token_id"] else None,
            eos_token_ids=tuple(special["eos_token_id"]),
            **extra,
        )

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> ModelConfig:
        """The config of a checkpoint directory, or of a GGUF file (from its metadata)."""
        if is_gguf(path):
            from freetoken.loader.gguf_arch import hf_config
            from freetoken.loader.gguf_file import GgufFile

            return cls.from_hf_dict(hf_config(GgufFile(path)), source=f"{path} (GGUF metadata)")
        return cls.from_dir(path)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise CheckpointError(f"{model_dir}: not a directory")
        path = checkpoint_file(model_dir, "config.json")
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: not a checkpoint (no config.json)")
        return cls.from_hf_dict(read_json_object(path), source=str(path))

    def check_context(self, max_len: int, source: str = "config.json") -> None:
        """Refuse a context over which this model's sliding window would bind: the engine's
        attention sees every earlier token (but gpt_oss's `sliding_layers`). Up to the window the two agree."""
        if self.sliding_window is not None and self.sliding_window < max_len and not self.sliding_layers:
            raise CheckpointError(
                f"{source}: sliding_window: this model attends over a sliding window of {self.sliding_window} "
                f"tokens, which freetoken does not implement; the context is {max_len} tokens: pass "
                f"--max-model-len {self.sliding_window} or less (the window then never binds)"
            )


def _sliding_window(f: JsonFields, arch: str) -> int | None:
    """The attention window some layer uses, as transformers reads each family's config; None
    when every layer attends to the whole context."""
    if arch == "olmoe":
        return None
    if arch == "mixtral":  # every layer, whenever a window is given
        return f.optional_integer("sliding_window", minimum=1)
    if not f.flag("use_sliding_window", False):
        return None  # the window's value is not read (configs saved with the window off hold 0 there)
    window = f.optional_integer("sliding_window", minimum=1)
    if arch == "qwen2_moe":
        types = f.raw.get("layer_types")
        if types is None:
            # the even layers below max_window_layers: layer 0 whenever that is positive
            return window if f.integer("max_window_layers", minimum=0, default=28) > 0 else None
        if not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
            raise f.error("layer_types", f"expected a list of strings, got {type(types).__name__}")
        return window if "sliding_attention" in types else None
    return window


GREEDY_BELOW = 1e-5  # temperatures below this sample greedily
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 512


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling for one request. temperature 0 = greedy; top_k 0 and top_p 1 = off."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; N >= 0: each token's logprob plus the top N alternatives
    skip_special_tokens: bool = True  # False keeps e.g. Mixtral's [TOOL_CALLS] in the text for parsers

    @property
    def greedy(self) -> bool:
        # Below this, dividing logits by the temperature overflows fp32: the limit is argmax.
        return self.temperature < GREEDY_BELOW

    def validate(self) -> SamplingParams:
        def bad(param: str, why: str) -> RequestError:
            return RequestError(f"{param}: {why}", param=param)

        if self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise bad("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", f"must be between 0 and 20, got {self.logprobs}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise bad("seed", f"must fit in a signed 64-bit integer, got {self.seed}")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "token ids must be >= 0")
        return self


