"""Wires the expert hierarchy from the config: the policy, the slot count, the split ratio, the
slot cache, the CPU executor and the MoE backend the model calls. Every combination of settings is
checked here, once, before anything is allocated on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.cache.budget import decide_slots
from freetoken.cache.host_pool import HostExpertPool
from freetoken.cache.offloaded_moe import OffloadedExperts
from freetoken.cache.slot_cache import SlotCache
from freetoken.config import EngineConfig
from freetoken.errors import CheckpointError, ConfigError
from freetoken.moe.live_policy import LivePolicyChoice
from freetoken.moe.live_split import LiveSplit
from freetoken.moe.live_threads import LiveThreads
from freetoken.moe.policy import Hybrid, Policy, configured_policy, make_policy
from freetoken.moe.profile_key import profile_key
from freetoken.reference.expert_cache import pcie_share, share_q16
from freetoken.trace import NULL_RECORDER, TraceRecorder


@dataclass
class ExpertHierarchy:
    policy: Policy
    slots: SlotCache
    executor: object | None  # the CpuExpertExecutor of every dynamic cache (None: resident)
    backend: OffloadedExperts  # what the model's MoE layers call
    gemm: str  # "triton" or "torch": the GEMM over slots
    ratio: float | None  # hybrid's PCIe share r
    ratio_source: str  # where r came from
    slot_reason: str  # why the cache has its slot count
    profile_bps: tuple[float, float] | None = None  # (PCIe fill, CPU expert) bytes/s r came from, if a profile
    live_split: LiveSplit | None = None  # hybrid's split following the engine's timings (None: fixed r)
    live_choice: LivePolicyChoice | None = None  # auto: transfer, hybrid or cpu, chosen per step while serving
    live_threads: LiveThreads | None = None  # with the live split: the CPU executor's thread count following it


def build_expert_hierarchy(config: EngineConfig, pool: HostExpertPool, *, device: str, dtype: torch.dtype,
                           slot_bytes: int, recorder: TraceRecorder = NULL_RECORDER) -> ExpertHierarchy:
    """slot_bytes: one device slot's bytes (an expert as the pool's format stores it on the device)."""
    cfg = pool.config
    try:
        named = configured_policy(config.moe.policy, config.moe.params)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    pool_experts = cfg.num_sparse_layers * cfg.num_experts
    free = torch.cuda.mem_get_info()[0] if device == "cuda" else None
    try:
        slots, reason = decide_slots(
            every_expert=named is not None and named.every_expert, pool_experts=pool_experts, slot_bytes=slot_bytes,
            free_bytes=free, headroom_bytes=int(config.moe.gpu_memory_headroom_gb * 2**30),
            slots=config.moe.cache_slots, rate=config.moe.cache_rate,
        )
    except ValueError as exc:
        raise CheckpointError(f"--moe-policy {config.moe.policy}: {exc}") from exc
    choosing = named is None and slots < pool_experts  # auto: the live choice among transfer, hybrid, cpu
    if named is None:
        policy = make_policy(Hybrid.name, config.moe.params) if choosing else make_policy("resident")
    else:
        policy = named
    # (a fixed placement with a slot for every expert never routes to the CPU)
    every_expert_placed = policy.fixed_placement and slots >= pool_experts
    if policy.routes_to_cpu and not pool.format.cpu_executable and not every_expert_placed:
        raise CheckpointError(pool.format.cpu_refusal(policy.name, config.resolved_dtype()))
    ratio, ratio_source, profile_bps = split_with_bandwidths(policy, config.moe.bw_profile, device,
                                                             profile_key(pool.format))
    try:
        cache = SlotCache(pool, slots, policy, share_q16(ratio or 0.0), device, dtype)
    except ValueError as exc:
        raise CheckpointError(f"--moe-policy {policy.name} with {slots} expert slots: {exc}") from exc
    executor = None
    # Every dynamic cache gets one: a cache smaller than a layer's routed experts (or resized
    # below them) leaves the routes it cannot slot to the CPU, whatever the policy.
    if not policy.every_expert and pool.format.cpu_executable:
        from freetoken.kernels.cpu.executor import CpuExpertExecutor

        w13, w2 = pool.format.cpu_banks((pool.w13, pool.w2))
        executor = CpuExpertExecutor(w13, w2, config.moe.cpu_threads, recorder=recorder,
                                     watchdog_s=config.graphs.watchdog_s, layout=pool.format.cpu_layout(cfg))
    gemm = config.kernels.moe_gemm if config.kernels.moe_gemm != "auto" else pool.format.auto_gemm(device)
    backend = OffloadedExperts(
        cache, executor, [pool.format.slot_gemm(gemm, layer) for layer in range(cfg.num_layers)], recorder,
        stream_min_tokens=config.moe.prefill_stream_min_tokens, cpu_branch=config.moe.cpu_branch,
    )
    live_split = live_choice = live_threads = None
    if isinstance(policy, Hybrid) and policy.adaptive and profile_bps is not None and executor is not None:
        live_split = LiveSplit(backend, *profile_bps)
        ratio_source = f"live, from {ratio_source}"
        # the executor's thread count follows the same CPU samples, from the profile's CPU rate
        # where it measured one (moe/live_threads.py)
        from freetoken.moe.bandwidth_profile import DEFAULT_CPU_BPS

        cpu_bps = profile_bps[1]
        live_threads = LiveThreads(executor, reference=cpu_bps if cpu_bps != DEFAULT_CPU_BPS else None)
        live_split.on_step = live_threads.fold
    if choosing:
        live_choice = LivePolicyChoice(cache, live_split, share_q16(ratio), recorder=recorder)
    return ExpertHierarchy(policy, cache, executor, backend, gemm, ratio, ratio_source, reason, profile_bps, live_split,
                           live_choice, live_threads)


def split_ratio(policy: Policy, bw_profile: str | None, device: str, expert_format: str) -> tuple[float | None, str]:
    """Hybrid's PCIe share r and where it came from: its own parameter, else the machine's
    bandwidth profile (`bench bw`) for the pool's format (`expert_format`: its profile key);
    None for the other policies."""
    ratio, source, _ = split_with_bandwidths(policy, bw_profile, device, expert_format)
    return ratio, source


def split_with_bandwidths(policy: Policy, bw_profile: str | None, device: str,
                          expert_format: str) -> tuple[float | None, str, tuple[float, float] | None]:
    """`split_ratio`, and the (PCIe fill, CPU expert) bytes/s it was computed from when they
    came from the profile (or its stated defaults); None when r is a parameter or unused."""
    if not isinstance(policy, Hybrid):
        return None, "", None
    if policy.ratio is not None:
        return policy.ratio, "moe param ratio", None
    from freetoken.moe.bandwidth_profile import load_ratio

    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    pcie, cpu, source = load_ratio(bw_profile, gpu, expert_format)
    return pcie_share(pcie, cpu), source, (pcie, cpu)
