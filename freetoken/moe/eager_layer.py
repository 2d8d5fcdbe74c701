"""The eager executor of a MoE layer's plan: the host reads the plan, so the layer is not
capturable, but it needs no doorbell (prefill chunks, eager decode, machines without CUDA).

Shape legend: N tokens, K top-k, H hidden.

One layer:
 1. plan (routes as slot ids, -1 for CPU routes; the copies to make);
 2. the CPU branch starts first: CPU routes go to the CPU executor's worker, which computes
    them from the host pool while this thread continues;
 3. the planned copies fill their slots (on the copy stream on CUDA);
 4. the GPU computes every slot route (hits and just-filled experts);
 5. GPU partial + CPU partial.
Inputs of more than MAX_PLAN_ROUTES routes (short prefill chunks) run as token slices, each
through steps 1-5 before the next.

Live bandwidths (cache/live_bandwidth.py): a layer's fill is one PCIe sample (its experts' bytes
over its time: on CUDA two events on the copy stream, read once they have passed, never waited
for; on a CPU device the host time of the copy), a layer's CPU call one CPU sample (its distinct
experts' bytes over the worker's time for the call, or the calling thread's for an inline call).
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np
import torch

from freetoken.cache.live_bandwidth import LiveBandwidths
from freetoken.moe.planner import MAX_PLAN_ROUTES
from freetoken.moe.resident_layer import eager_resident
from freetoken.moe.slot_gemm import GemmFn
from freetoken.trace import TraceRecorder


class EagerLayer:
    def __init__(self, executor, gemms: list[GemmFn], recorder: TraceRecorder, copy_stream,
                 stream_min_tokens: int | None, cpu_branch: str, live: LiveBandwidths) -> None:
        """cpu_branch: "worker" hands CPU routes to the executor's worker before the fill and the
        GPU GEMM are queued; "inline" queues those first and computes the CPU routes on this
        thread while the device works (no thread hand-offs)."""
        if cpu_branch not in ("worker", "inline"):
            raise ValueError(f"cpu_branch must be 'worker' or 'inline', got {cpu_branch!r}")
        self.cpu_branch = cpu_branch
        self.executor = executor  # CpuExpertExecutor, or None when the policy never routes to the CPU
        self.gemms = gemms
        self.trace = recorder
        self.copy_stream = copy_stream  # None: the host is the device, a fill is done when it returns
        self.stream_min_tokens = stream_min_tokens
        self.live = live
        # CUDA fills still in flight: (start event, end event, bytes), read once they passed
        self._timed_fills: deque = deque()
        self._timed_lock = threading.Lock()

    def run(self, cache, streamer, layer: int, x: torch.Tensor, weights: torch.Tensor,
            ids: torch.Tensor) -> torch.Tensor:
        """One layer over `cache` (a SlotCache); `streamer`: the prefill streamer, or None."""
        track = "gpu_runner"
        if cache.resident_base:  # every expert has a fixed slot: no plan, no host sync
            return eager_resident(cache, layer, x, weights, ids, self.gemms[layer], self.stream_min_tokens)
        if streamer is not None and x.shape[0] >= self.stream_min_tokens:
            with self.trace.span(track, "streamed_layer", layer=layer, tokens=x.shape[0]):
                return streamer.experts(layer, x, weights, ids, cache.pool.format.prefill_gemm(layer))
        rows = max(1, MAX_PLAN_ROUTES // ids.shape[1])
        if ids.shape[0] > rows:  # token slices, each planned, filled and computed before the next
            return torch.cat([self._planned(cache, layer, x[i : i + rows], weights[i : i + rows], ids[i : i + rows])
                              for i in range(0, ids.shape[0], rows)])
        return self._planned(cache, layer, x, weights, ids)

    def _planned(self, cache, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Steps 1-5 for at most MAX_PLAN_ROUTES routes."""
        track = "gpu_runner"
        with self.trace.span(track, "plan", layer=layer):
            plan = cache.plan(layer, ids)
        ticket = None
        cpu_mask = plan.routes_host < 0  # [N, K]
        on_cpu = bool(cpu_mask.any())
        if on_cpu:
            if self.executor is None:
                raise RuntimeError(f"policy {cache.policy.name!r} routed experts to the CPU, but no CPU "
                                   "executor runs")
            # One device-to-host copy for everything the CPU branch reads (ids are exact in fp32).
            n, h = x.shape
            packed = torch.cat([x.float().flatten(), weights.float().flatten(), ids.float().flatten()]).cpu()
            x_host = packed[: n * h].view(n, h).numpy()
            w_host = packed[n * h : n * h + weights.numel()].view(weights.shape).numpy()
            ids_host = packed[n * h + weights.numel() :].view(ids.shape).to(torch.int32)
            fids = torch.where(cpu_mask, ids_host + layer * cache.pool.config.num_experts, -1).numpy()
            out = np.zeros_like(x_host)
            cpu_job = (x_host, w_host, fids, out)
            if self.cpu_branch == "worker":
                ticket = self.executor.submit(*cpu_job)
        # Eager steps wait for background fills too: only their routes (on the CPU) differ.
        self._fill(cache, plan.copies + plan.background)
        with self.trace.span(track, "gpu_experts", layer=layer):
            y = self.gemms[layer](x, weights, plan.routes, cache.w13, cache.w2)
        if on_cpu:
            if ticket is not None:
                with self.trace.span(track, "wait_cpu", layer=layer):
                    cpu_out = ticket.wait()
                cpu_ns = ticket.compute_ns
            else:
                started = time.perf_counter_ns()
                cpu_out = self.executor.run_inline(*cpu_job)
                cpu_ns = time.perf_counter_ns() - started
            experts = np.unique(fids[fids >= 0]).size  # the kernel reads each distinct expert once
            self.live.cpu_expert.add(experts * cache.pool.expert_bytes, cpu_ns)
            y = y + torch.from_numpy(cpu_out).to(device=y.device, dtype=y.dtype)
        if self.trace.enabled:
            self.trace.counter(track, f"layer{layer}.hits", plan.hits)
            self.trace.counter(track, f"layer{layer}.misses", plan.misses)
            self.trace.counter(track, f"layer{layer}.fetched", len(plan.copies) + len(plan.background))
            self.trace.counter(track, f"layer{layer}.cpu_routes", int(cpu_mask.sum()))
        return y

    def _fill(self, cache, copies: list[tuple[int, int]]) -> None:
        """Fill the planned slots."""
        if not copies:
            return
        nbytes = len(copies) * cache.pool.expert_bytes
        with self.trace.span("pcie_mover", "fill", experts=len(copies)):
            if self.copy_stream is None:
                started = time.perf_counter_ns()
                cache.fill(copies)
                self.live.pcie_fill.add(nbytes, time.perf_counter_ns() - started)
                return
            current = torch.cuda.current_stream()
            # The slots being overwritten may still be read by earlier GPU work on this stream.
            self.copy_stream.wait_stream(current)
            with torch.cuda.stream(self.copy_stream):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                cache.fill(copies)
                end.record()
            current.wait_stream(self.copy_stream)
        with self._timed_lock:
            self._timed_fills.append((start, end, nbytes))
        self.collect_fill_timings()

    def collect_fill_timings(self) -> None:
        """Turn the CUDA fills that have passed into samples (a query, never a wait)."""
        with self._timed_lock:
            while self._timed_fills and self._timed_fills[0][1].query():
                start, end, nbytes = self._timed_fills.popleft()
                self.live.pcie_fill.add(nbytes, int(start.elapsed_time(end) * 1e6))
