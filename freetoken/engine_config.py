"""`EngineConfig`: how the engine runs, as a tree of frozen sub-configs (config_tree.py).

The root holds what sizes everything (the model, device, dtype, context length and running
sequences); each sub-config one concern: the KV cache, the scheduler, the expert hierarchy,
decode's CUDA graphs, the kernel choices, and the traces. Every default is written once, on its
field; the serve/generate/bench flags are generated from the fields (cli_args.py).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import msgspec

from freetoken.config_tree import DIAGNOSTICS, MOE_GROUP, cli_flag, leaves, no_flag, value_at
from freetoken.errors import ConfigError
from freetoken.moe.policy import AUTO, POLICIES, configured_policy

Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "float32", "bfloat16", "float16"]


class KvConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The paged KV cache."""

    tokens: Annotated[int | None, cli_flag(
        "--kv-tokens", "KV cache size in tokens (default: --max-model-len for each running request)")] = None
    page_size: Annotated[int, no_flag("tests")] = 16  # token positions per KV page (the unit of prefix sharing)


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How the scheduler admits prompts between decode steps."""

    # Decode steps of running requests run between prefill steps. With experts offloaded every
    # chunk streams each expert layer once, so larger chunks amortise it.
    prefill_chunk: Annotated[int, cli_flag(
        "--prefill-chunk", "prompt tokens per prefill step (each streams every offloaded expert layer once)")] = 8192
    # a new request reuses the KV of a finished one sharing its prefix
    prefix_reuse: Annotated[bool, cli_flag("--no-prefix-reuse", "never share cached KV pages between requests")] = True
    # Linear-attention models resume a shared prefix only where their recurrent state was saved
    # (cache/state_anchors.py); each saved state is a whole sequence's, kept in host memory.
    state_anchor_gb: Annotated[float, cli_flag(
        "--state-anchor-gb", "host memory for recurrent states saved at anchors (models with linear attention)",
        group=DIAGNOSTICS)] = 4.0
    # Saving a state ends a prefill chunk, a forward of its own (with offloaded experts, another pass
    # over them): an anchor that would end a shorter chunk is passed over, but the prompt's last.
    anchor_min_gap: Annotated[int, cli_flag(
        "--anchor-min-gap", "tokens: an anchor that would end a shorter prefill chunk saves no state "
        "(models with linear attention; the prompt's end always does)", group=DIAGNOSTICS)] = 64


class MoeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The expert hierarchy (moe/): which policy serves cache misses, with its parameters
    (moe/policy.py; `bench --moe-param key=value`), how many GPU expert slots, and the CPU side."""

    # "auto": `resident` when every expert fits the device budget, else transfer, hybrid or cpu
    # chosen live (moe/live_policy.py).
    policy: Annotated[str, cli_flag(
        "--moe-policy", "how cache misses are served; auto: resident if every expert fits, else transfer, "
        "hybrid or cpu, chosen while serving by timing each",
        group=MOE_GROUP, choices=(AUTO, *POLICIES))] = "auto"
    params: Annotated[dict[str, Any], no_flag("bench --moe-param")] = msgspec.field(default_factory=dict)
    # the slots as an exact count, or as a fraction of the expert pool in (0, 1]
    cache_slots: Annotated[int | None, cli_flag(
        "--moe-cache-slots", "GPU expert slots (default: what fits)", group=MOE_GROUP,
        exclusive="moe cache size")] = None
    cache_rate: Annotated[float | None, cli_flag(
        "--moe-cache-rate", "GPU expert slots as a fraction of the pool", group=MOE_GROUP,
        exclusive="moe cache size")] = None
    gpu_memory_headroom_gb: Annotated[float, no_flag("library callers")] = 2.0  # what the slot budget leaves free
    cpu_threads: Annotated[int | None, cli_flag(
        "--cpu-threads", "CPU expert workers (default: physical cores)", group=MOE_GROUP)] = None
    # Who runs CPU routes in the eager path: the executor's worker, started before the GPU work
    # is queued, or this thread after queuing it (no thread hand-offs; `bench` only, unmeasured).
    cpu_branch: Annotated[Literal["worker", "inline"], no_flag("bench --moe-param cpu_branch=")] = "worker"
    # None: the profile at its default location
    bw_profile: Annotated[str | None, cli_flag(
        "--bw-profile", "bandwidth profile file written by `bench bw`", group=MOE_GROUP)] = None
    # prefill chunks this long stream whole expert layers; None: never
    prefill_stream_min_tokens: Annotated[int | None, no_flag("tests")] = 64


class GraphConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Decode in CUDA graphs (CUDA only; see engine/decode_graphs.py)."""

    # eager: launch every kernel from Python instead
    eager: Annotated[bool, cli_flag(
        "--eager", "launch decode kernels one by one instead of replaying CUDA graphs (CUDA only)",
        group=DIAGNOSTICS)] = False
    # the batch sizes captured; None: powers of two up to max_running_requests
    batch_sizes: Annotated[tuple[int, ...] | None, no_flag("tests")] = None
    # a CPU-branch handshake stalled this long fails its step
    watchdog_s: Annotated[float, no_flag("tests")] = 10.0


class KernelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Which kernels the engine launches, and how."""

    # Programmatic dependent launch (CUDA, compute capability 9+; kernels/triton/pdl.py): the
    # engine's Triton kernels start while the kernel before them drains. Off: plain stream
    # order (same outputs bit for bit; for comparison and for drivers that mishandle it).
    pdl: Annotated[bool, cli_flag(
        "--no-pdl", "launch the engine's Triton kernels in plain stream order instead of letting each start "
        "while the one before drains (programmatic dependent launch, compute capability 9+)", group=DIAGNOSTICS)] = True
    # "fused": Triton RMSNorm/rotary on CUDA and decode attention over fixed key buckets (what
    # graphs need). "reference": the reference ops at exact shapes, launched eagerly, with the
    # rounding transformers has (the bf16 parity checks run this way).
    dense: Annotated[Literal["fused", "reference"], cli_flag(
        "--dense-kernels", "attention, norms and routing as fused Triton kernels (CUDA), or the reference "
        "torch ops at exact shapes (for debugging; decode then runs eagerly)", group=DIAGNOSTICS)] = "fused"
    moe_gemm: Annotated[Literal["auto", "torch", "triton"], cli_flag(
        "--moe-gemm", "the expert GEMM over cache slots; auto: triton on CUDA, torch on CPU",
        group=DIAGNOSTICS)] = "auto"


class TraceConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine records, and the routing it replays."""

    timeline: Annotated[str | None, cli_flag(
        "--trace", "write a Perfetto-loadable JSON timeline here at exit", group=DIAGNOSTICS)] = None
    record_routing: Annotated[str | None, cli_flag(
        "--record-routing", "write routing decisions as JSON lines here", group=DIAGNOSTICS)] = None
    routing_replay: Annotated[str | None, cli_flag(
        "--routing-replay", "replace the router's choices with this trace's", group=DIAGNOSTICS)] = None


# leaves that count something (None where None means a default)
_POSITIVE_COUNTS = ("max_model_len", "max_running_requests", "kv.tokens", "kv.page_size", "scheduler.prefill_chunk",
                    "moe.cpu_threads")


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: Annotated[str, cli_flag(
        "--model", "a Hugging Face checkpoint directory, a GGUF file (FILE.gguf, or a split model's first part), "
        "or 'demo' (a tiny synthetic model built on first use)")] = "demo"
    device: Annotated[Device, cli_flag("--device")] = "auto"
    dtype: Annotated[DType, cli_flag("--dtype", "auto: bfloat16 on CUDA, float32 on CPU")] = "auto"
    # the KV cache's positions per running sequence
    max_model_len: Annotated[int, cli_flag("--max-model-len", "prompt + output tokens per sequence")] = 4096
    # the KV cache's rows, and the largest decode batch
    max_running_requests: Annotated[int, cli_flag("--max-running-requests", "sequences decoded together")] = 4
    kv: KvConfig = msgspec.field(default_factory=KvConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    moe: MoeConfig = msgspec.field(default_factory=MoeConfig)
    graphs: GraphConfig = msgspec.field(default_factory=GraphConfig)
    kernels: KernelConfig = msgspec.field(default_factory=KernelConfig)
    trace: TraceConfig = msgspec.field(default_factory=TraceConfig)
    cache_dir: Annotated[str, no_flag("library callers")] = "~/.cache/freetoken"  # where the demo checkpoint is built
    served_model_name: Annotated[str | None, no_flag("library callers")] = None  # None: the checkpoint's name

    def validate(self) -> EngineConfig:
        """Refuse settings no request could be served under, before anything is loaded."""
        flags = {leaf.path: leaf.flag for leaf in leaves(EngineConfig)}
        for path in _POSITIVE_COUNTS:
            value = value_at(self, path)
            if value is not None and value < 1:
                raise ConfigError(f"{flags[path] or path}: must be at least 1, got {value}")
        if self.scheduler.anchor_min_gap < 0:
            raise ConfigError(f"--anchor-min-gap: must be at least 0, got {self.scheduler.anchor_min_gap}")
        headroom = self.moe.gpu_memory_headroom_gb
        if not (math.isfinite(headroom) and headroom >= 0):
            raise ConfigError(f"moe.gpu_memory_headroom_gb: must be a finite number >= 0, got {headroom}")
        configured_policy(self.moe.policy, self.moe.params)  # a bad policy or parameter: refused before loading
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
