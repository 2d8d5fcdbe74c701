"""Typed configuration: the one place for every knob.

- ModelConfig: the architecture, normalised from a Hugging Face `config.json` of any supported
  family (field names differ between families; the engine sees one shape).
- SamplingParams: what a request asks of the sampler; validated before it enters the engine.
- EngineConfig: how the engine runs (device, dtype, context length).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from freetoken.errors import CheckpointError, ConfigError, FreetokenError, RequestError
from freetoken.loader.gpt_oss_fields import gpt_oss_fields
from freetoken.loader.json_fields import JsonFields, read_json_object
from freetoken.loader.paths import checkpoint_file, is_gguf
from freetoken.loader.qwen3_5_fields import HYBRID_ARCHS, LinearAttentionShape, hybrid_fields, text_config
from freetoken.loader.rope_scaling import YarnRope, read_yarn
from freetoken.moe.policy import AUTO, POLICIES, configured_policy

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


Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "float32", "bfloat16", "float16"]


def cli_flag(
    help: str | None = None, *, group: str = "", choices: tuple[str, ...] | None = None, exclusive: str | None = None
) -> msgspec.Meta:
    """Marks a config field as a command-line flag (cli_args.py builds the parser from these): its
    help, its help group ("" for the command's own options), choices where the type does not name
    them, and a mutually exclusive set it belongs to. The flag's name is the field's (`--no-<field>`
    for a switch that is on by default) and its default is the field's default."""
    return msgspec.Meta(description=help, extra={"cli": {"group": group, "choices": choices, "exclusive": exclusive}})


MOE_GROUP = "expert hierarchy"
DIAGNOSTICS = "diagnostics"

# EngineConfig fields that count something (None where None means a default), with their flag
_POSITIVE_COUNTS = (
    ("max_model_len", "--max-model-len"),
    ("max_running_requests", "--max-running-requests"),
    ("kv_tokens", "--kv-tokens"),
    ("kv_page_size", None),
    ("prefill_chunk", "--prefill-chunk"),
    ("cpu_threads", "--cpu-threads"),
)


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: Annotated[str, cli_flag(
        "a Hugging Face checkpoint directory, a GGUF file (FILE.gguf, or a split model's first part), "
        "or 'demo' (a tiny synthetic model built on first use)")] = "demo"
    device: Annotated[Device, cli_flag()] = "auto"
    dtype: Annotated[DType, cli_flag("auto: bfloat16 on CUDA, float32 on CPU")] = "auto"
    # the KV cache's positions per running sequence
    max_model_len: Annotated[int, cli_flag("prompt + output tokens per sequence")] = 4096
    max_running_requests: Annotated[int, cli_flag("sequences decoded together")] = 4  # KV cache rows
    kv_tokens: Annotated[int | None, cli_flag(
        "KV cache size in tokens (default: --max-model-len for each running request)")] = None
    kv_page_size: int = 16  # token positions per KV page (the unit of prefix sharing)
    # Decode steps of running requests run between prefill steps. With experts offloaded every
    # chunk streams each expert layer once, so larger chunks amortise it.
    prefill_chunk: Annotated[int, cli_flag(
        "prompt tokens per prefill step (each streams every offloaded expert layer once)")] = 8192
    # a new request reuses the KV of a finished one sharing its prefix
    prefix_reuse: Annotated[bool, cli_flag("never share cached KV pages between requests")] = True
    prefill_stream_min_tokens: int | None = 64  # chunks this long stream whole expert layers; None: never
    cache_dir: str = "~/.cache/freetoken"  # where the demo checkpoint is built once
    # The expert hierarchy (moe/): which policy serves cache misses, with its parameters
    # (moe/policy.py; `bench --moe-param key=value`), and how many GPU expert slots.
    # "auto": `resident` when every expert fits the device budget, else `hybrid`.
    moe_policy: Annotated[str, cli_flag(
        "how cache misses are served; auto: resident if every expert fits, else hybrid",
        group=MOE_GROUP, choices=(AUTO, *POLICIES))] = "auto"
    moe_params: dict[str, Any] = msgspec.field(default_factory=dict)
    # the slots as an exact count, or as a fraction of the expert pool in (0, 1]
    moe_cache_slots: Annotated[int | None, cli_flag(
        "GPU expert slots (default: what fits)", group=MOE_GROUP, exclusive="moe cache size")] = None
    moe_cache_rate: Annotated[float | None, cli_flag(
        "GPU expert slots as a fraction of the pool", group=MOE_GROUP, exclusive="moe cache size")] = None
    gpu_memory_headroom_gb: float = 2.0  # device memory the slot budget leaves free
    cpu_threads: Annotated[int | None, cli_flag(
        "CPU expert workers (default: physical cores)", group=MOE_GROUP)] = None
    # Who runs CPU routes in the eager path: the executor's worker, started before the GPU work
    # is queued, or this thread after queuing it (no thread hand-offs; `bench` only, unmeasured).
    cpu_branch: Literal["worker", "inline"] = "worker"
    # Decode in CUDA graphs (CUDA only; see engine/decode_graphs.py). eager: launch every
    # kernel from Python instead. graph_batch_sizes: batch sizes captured (None: powers of two
    # up to max_running_requests). A CPU-branch handshake stalled this long fails its step.
    eager: Annotated[bool, cli_flag(
        "launch decode kernels one by one instead of replaying CUDA graphs (CUDA only)", group=DIAGNOSTICS)] = False
    # Programmatic dependent launch (CUDA, compute capability 9+; kernels/triton/pdl.py): the
    # engine's Triton kernels start while the kernel before them drains. Off: plain stream
    # order (same outputs bit for bit; for comparison and for drivers that mishandle it).
    pdl: Annotated[bool, cli_flag(
        "launch the engine's Triton kernels in plain stream order instead of letting each start "
        "while the one before drains (programmatic dependent launch, compute capability 9+)", group=DIAGNOSTICS)] = True
    # "fused": Triton RMSNorm/rotary on CUDA and decode attention over fixed key buckets (what
    # graphs need). "reference": the reference ops at exact shapes, launched eagerly, with the
    # rounding transformers has (the bf16 parity checks run this way).
    dense_kernels: Annotated[Literal["fused", "reference"], cli_flag(
        "attention, norms and routing as fused Triton kernels (CUDA), or the reference "
        "torch ops at exact shapes (for debugging; decode then runs eagerly)", group=DIAGNOSTICS)] = "fused"
    moe_gemm: Annotated[Literal["auto", "torch", "triton"], cli_flag(
        "the expert GEMM over cache slots; auto: triton on CUDA, torch on CPU", group=DIAGNOSTICS)] = "auto"
    graph_batch_sizes: tuple[int, ...] | None = None
    graph_watchdog_s: float = 10.0
    # None: the profile at its default location
    bw_profile: Annotated[str | None, cli_flag("bandwidth profile file written by `bench bw`", group=MOE_GROUP)] = None
    trace: Annotated[str | None, cli_flag(
        "write a Perfetto-loadable JSON timeline here at exit", group=DIAGNOSTICS)] = None
    record_routing: Annotated[str | None, cli_flag(
        "write routing decisions as JSON lines here", group=DIAGNOSTICS)] = None
    routing_replay: Annotated[str | None, cli_flag(
        "replace the router's choices with this trace's", group=DIAGNOSTICS)] = None
    served_model_name: str | None = None

    def validate(self) -> EngineConfig:
        """Refuse settings no request could be served under, before anything is loaded."""
        for field, flag in _POSITIVE_COUNTS:
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ConfigError(f"{flag or field}: must be at least 1, got {value}")
        headroom = self.gpu_memory_headroom_gb
        if not (math.isfinite(headroom) and headroom >= 0):
            raise ConfigError(f"gpu_memory_headroom_gb: must be a finite number >= 0, got {headroom}")
        configured_policy(self.moe_policy, self.moe_params)  # a bad policy or parameter: refused before loading
        return self

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device() == "cuda" else "float32"


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: Annotated[str, cli_flag(
        "the address to listen on (default: loopback only; 0.0.0.0 for every interface)")] = "127.0.0.1"
    port: Annotated[int, cli_flag()] = 8000
    # Required on every route but /health when set ("Authorization: Bearer <key>" or "x-api-key").
    api_key: str | None = None
    # POST /v1/cache/resize changes what every client gets: with a token it needs
    # "Authorization: Bearer <token>" (which also passes for the API key); without one it is open
    # only on a loopback address, to requests whose Host is a loopback name (DNS rebinding).
    admin_token: str | None = None
    # Origins whose web pages may call the APIs (CORS); none by default, so browsers refuse.
    allow_origins: tuple[str, ...] = ()
    # Request bodies above this get a 413 (a long agent context with its tools runs to a few MiB).
    max_request_bytes: int = 32 << 20
    max_json_depth: int = 64  # bodies nesting arrays/objects deeper get a 400
    header_timeout_s: float = 10.0  # a request line and headers must arrive within this
    body_timeout_s: float = 30.0  # a body must arrive within this (408)
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    log_format: Annotated[Literal["text", "json"], cli_flag(
        "the access log's lines (one per request, on stderr): text, or JSON", group=DIAGNOSTICS)] = "text"

    def __repr__(self) -> str:  # the secrets stay out of logs
        fields = {f: getattr(self, f) for f in self.__struct_fields__}
        for secret in ("api_key", "admin_token"):
            if fields[secret] is not None:
                fields[secret] = "<set>"
        return f"ServerConfig({', '.join(f'{k}={v!r}' for k, v in fields.items())})"

    API_KEY_ENV: ClassVar[str] = "FREETOKEN_API_KEY"
    ADMIN_TOKEN_ENV: ClassVar[str] = "FREETOKEN_ADMIN_TOKEN"

    @staticmethod
    def secret(value: str | None, file: str | None, env: str, flag: str) -> str | None:
        """A secret from its flag, else its file (`--<flag>-file`), else the environment variable `env`.

        A file keeps the secret out of `ps`; its surrounding whitespace (a final newline) is dropped."""
        if value is not None and file is not None:
            raise FreetokenError(f"give --{flag} or --{flag}-file, not both")
        if file is not None:
            try:
                value = Path(file).read_text().strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise FreetokenError(f"--{flag}-file {file}: cannot read it: {exc}") from None
            if not value:
                raise FreetokenError(f"--{flag}-file {file}: the file is empty")
            return value
        if value is None:
            value = os.environ.get(env) or None
        if value is not None and not value.strip():
            raise FreetokenError(f"--{flag}: the value is empty")
        return value
