"""The MoE backend over the expert hierarchy: slot cache hits on the GPU, misses split between
PCIe fills and CPU execution by the policy.

Shape legend: N tokens, K top-k, H hidden.

One layer, eager path:
 1. plan (routes as slot ids, -1 for CPU routes; the copies to make);
 2. the CPU branch starts first: CPU routes go to the CPU executor's worker, which computes
    them from the host pool while this thread continues;
 3. the planned copies fill their slots (on the copy stream on CUDA);
 4. the GPU computes every slot route (hits and just-filled experts);
 5. GPU partial + CPU partial.
The CPU and GPU partial sums are each exact sums of per-expert terms, so any placement gives
the same output up to the order of floating-point additions.

Live bandwidths (cache/live_bandwidth.py), eager path: a layer's fill is one PCIe sample (its
experts' bytes over its time: on CUDA two events on the copy stream, read once they have
passed, never waited for; on a CPU device the host time of the copy), a layer's CPU call one
CPU sample (its distinct experts' bytes over the worker's time for the call, or the calling
thread's for an inline call).
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np
import torch

from freetoken.cache.live_bandwidth import LiveBandwidths
from freetoken.cache.prefill_stream import LayerStreamer
from freetoken.cache.slot_cache import SlotCache
from freetoken.moe.planner import MAX_PLAN_ROUTES
from freetoken.moe.slot_gemm import GemmFn
from freetoken.reference.fetch_rule import FetchRule
from freetoken.trace import NULL_RECORDER, TraceRecorder


class OffloadedExperts:
    def __init__(
        self,
        cache: SlotCache,
        executor,
        gemms: list[GemmFn],  # per layer, the pool's expert format's GEMM over slots (moe/expert_format.py)
        recorder: TraceRecorder = NULL_RECORDER,
        stream_min_tokens: int | None = 64,
        cpu_branch: str = "worker",
    ) -> None:
        """stream_min_tokens: forwards with at least this many tokens (prefill chunks) stream
        whole layers (cache/prefill_stream.py) instead of planning per expert; None: never.
        cpu_branch: "worker" hands CPU routes to the executor's worker before the fill and the
        GPU GEMM are queued; "inline" queues those first and computes the CPU routes on this
        thread while the device works (no thread hand-offs; the eager path's alternative)."""
        if cpu_branch not in ("worker", "inline"):
            raise ValueError(f"cpu_branch must be 'worker' or 'inline', got {cpu_branch!r}")
        self.cpu_branch = cpu_branch
        self.executor = executor  # CpuExpertExecutor, or None when the policy never routes to the CPU
        self.gemms = gemms
        self.trace = recorder
        self.num_experts = cache.pool.config.num_experts
        self.copy_stream = torch.cuda.Stream() if cache.device == "cuda" else None
        self.stream_min_tokens = stream_min_tokens
        self.cache = cache
        # Set by the decode graphs while they run a step to capture (engine/decode_graphs.py):
        # the layer then runs without host synchronisation, its CPU branch through the doorbell.
        self.graph_plane = None
        self.live = LiveBandwidths()
        self.live.sources = {
            "pcie_fill": "eager fills: CUDA events around each layer's slot copies on the copy stream"
            if self.copy_stream is not None else "eager fills: host time of each layer's slot copies (a CPU "
            "device: a memory copy, no PCIe)",
            "cpu_expert": "eager CPU calls: each layer's distinct CPU experts over the executor's time for the call",
        }
        # CUDA eager fills still in flight: (start event, end event, bytes), read once they passed
        self._timed_fills: deque = deque()
        self._timed_lock = threading.Lock()

    @property
    def cache(self) -> SlotCache:
        return self._cache

    @cache.setter
    def cache(self, cache: SlotCache | None) -> None:
        """A new slot cache (live resize) gets its own prefill streamer."""
        self._cache = cache
        self.streamer = None
        # (a fixed placement never fetches: streaming through its slots would evict it for good)
        if cache is not None and cache.policy.streams_prefill and self.stream_min_tokens is not None:
            streamer = LayerStreamer(cache, self.copy_stream)
            self.streamer = streamer if streamer.available else None

    def experts(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        track = "gpu_runner"
        if self.graph_plane is not None:
            return self._experts_captured(layer, x, weights, ids)
        if self.cache.resident_base:  # every expert has a fixed slot: no plan, no host sync
            routes = (ids + self.cache.resident_base[layer]).to(torch.int32)
            self.cache.stats.add(layer, ids.numel(), 0, 0, 0, 0, ids.numel())
            # Prefill chunks group their tokens by expert (the grouped GEMM reads each expert once
            # for all its tokens); the slot GEMM reads an expert once per routed token.
            if self.stream_min_tokens is not None and x.shape[0] >= self.stream_min_tokens:
                base, E = self.cache.resident_base[layer], self.num_experts
                return self.cache.pool.format.prefill_gemm(layer)(x, weights, ids.to(torch.int32),
                                                                  self.cache.w13[base : base + E],
                                                                  self.cache.w2[base : base + E])
            return self.gemms[layer](x, weights, routes, self.cache.w13, self.cache.w2)
        if self.streamer is not None and x.shape[0] >= self.stream_min_tokens:
            with self.trace.span(track, "streamed_layer", layer=layer, tokens=x.shape[0]):
                return self.streamer.experts(layer, x, weights, ids, self.cache.pool.format.prefill_gemm(layer))
        rows = max(1, MAX_PLAN_ROUTES // ids.shape[1])
        if ids.shape[0] > rows:  # token slices, each planned, filled and computed before the next
            return torch.cat([self._planned(layer, x[i : i + rows], weights[i : i + rows], ids[i : i + rows])
                              for i in range(0, ids.shape[0], rows)])
        return self._planned(layer, x, weights, ids)

    def _planned(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Steps 1-5 of the module docstring for at most MAX_PLAN_ROUTES routes."""
        track = "gpu_runner"
        with self.trace.span(track, "plan", layer=layer):
            plan = self.cache.plan(layer, ids)
        ticket = None
        cpu_mask = plan.routes_host < 0  # [N, K]
        on_cpu = bool(cpu_mask.any())
        if on_cpu:
            if self.executor is None:
                raise RuntimeError(f"policy {self.cache.policy.name!r} routed experts to the CPU, but no CPU "
                                   "executor runs")
            # One device-to-host copy for everything the CPU branch reads (ids are exact in fp32).
            n, h = x.shape
            packed = torch.cat([x.float().flatten(), weights.float().flatten(), ids.float().flatten()]).cpu()
            x_host = packed[: n * h].view(n, h).numpy()
            w_host = packed[n * h : n * h + weights.numel()].view(weights.shape).numpy()
            ids_host = packed[n * h + weights.numel() :].view(ids.shape).to(torch.int32)
            fids = torch.where(cpu_mask, ids_host + layer * self.num_experts, -1).numpy()
            out = np.zeros_like(x_host)
            cpu_job = (x_host, w_host, fids, out)
            if self.cpu_branch == "worker":
                ticket = self.executor.submit(*cpu_job)
        # Eager steps wait for background fills too: only their routes (on the CPU) differ.
        self._fill(plan.copies + plan.background)
        with self.trace.span(track, "gpu_experts", layer=layer):
            y = self.gemms[layer](x, weights, plan.routes, self.cache.w13, self.cache.w2)
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
            self.live.cpu_expert.add(experts * self.cache.pool.expert_bytes, cpu_ns)
            y = y + torch.from_numpy(cpu_out).to(device=y.device, dtype=y.dtype)
        if self.trace.enabled:
            self.trace.counter(track, f"layer{layer}.hits", plan.hits)
            self.trace.counter(track, f"layer{layer}.misses", plan.misses)
            self.trace.counter(track, f"layer{layer}.fetched", len(plan.copies) + len(plan.background))
            self.trace.counter(track, f"layer{layer}.cpu_routes", int(cpu_mask.sum()))
        return y

    def _fill(self, copies: list[tuple[int, int]]) -> None:
        """Fill the planned slots."""
        if not copies:
            return
        nbytes = len(copies) * self.cache.pool.expert_bytes
        with self.trace.span("pcie_mover", "fill", experts=len(copies)):
            if self.copy_stream is None:
                started = time.perf_counter_ns()
                self.cache.fill(copies)
                self.live.pcie_fill.add(nbytes, time.perf_counter_ns() - started)
                return
            current = torch.cuda.current_stream()
            # The slots being overwritten may still be read by earlier GPU work on this stream.
            self.copy_stream.wait_stream(current)
            with torch.cuda.stream(self.copy_stream):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self.cache.fill(copies)
                end.record()
            current.wait_stream(self.copy_stream)
        with self._timed_lock:
            self._timed_fills.append((start, end, nbytes))
        self.collect_fill_timings()

    def live_status(self) -> dict:
        """The live bandwidth estimates (LiveBandwidths.status), fills that have passed included."""
        self.collect_fill_timings()
        return self.live.status()

    def collect_fill_timings(self) -> None:
        """Turn the CUDA eager fills that have passed into samples (a query, never a wait)."""
        with self._timed_lock:
            while self._timed_fills and self._timed_fills[0][1].query():
                start, end, nbytes = self._timed_fills.popleft()
                self.live.pcie_fill.add(nbytes, int(start.elapsed_time(end) * 1e6))

    @staticmethod
    def _bell(mailbox, layer: int, rows: int) -> tuple[int, int]:
        """A layer's ring: the bell word's address and the value it stores there."""
        from freetoken.kernels.cpu.doorbell import BELL
        from freetoken.kernels.cpu.mailbox import Mailbox

        return mailbox.address(BELL), Mailbox.bell_value(layer, rows)

    def _experts_captured(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """One layer with no host synchronisation (capturable in a CUDA graph): the device plan,
        the CPU routes through the doorbell, the device-driven slot fill, the slot GEMM; counters
        stay on the device (GraphPlane.counts). Same kernels and rounding as the eager path."""
        from freetoken.kernels.cpu.doorbell import ACK, DONE
        from freetoken.kernels.cpu.mailbox import Mailbox
        from freetoken.kernels.triton.cpu_handoff import PlanHandoff, add_cpu_result, post_cpu_work
        from freetoken.kernels.triton.plan import plan_layer_device
        from freetoken.kernels.triton.slot_fill import fill_slots

        plane, cache = self.graph_plane, self.cache
        n, k = ids.shape
        if cache.resident_base:
            plane.count_resident(layer, n * k)  # every route a hit: counted on the host, per replay
            routes = torch.add(ids, cache.resident_base[layer], out=torch.empty_like(ids, dtype=torch.int32))
            plane.stamp(layer, "start", "filled")
            y = self.gemms[layer](x, weights, routes, cache.w13, cache.w2)
            plane.stamp(layer, "computed", "merged")
            return y
        plane.stamp(layer, "start")
        counts = plane.counts[layer]  # STAT_FIELDS: hits, ..., routed
        with self.trace.span("gpu_runner", "capture_layer", layer=layer):
            mailbox = plane.mailbox if cache.policy.routes_to_cpu else None
            # fused: the hand-off kernels ring and wait themselves, and only where the layer
            # routes to the CPU (or is the step's last MoE layer, whose ring ends the step)
            fused, always = plane.flags is None, layer == plane.last_moe_layer
            # fused: the plan kernel posts the layer's CPU work itself
            handoff = None
            if mailbox is not None and fused:
                fill_rows = tickets = None
                if plane.copy_fills:  # the CPU queues them on the copy engine; the kernel numbers them
                    fill_rows = (mailbox.fill_slots_t, mailbox.fill_fids_t)
                    tickets = plane.fill_ticket_words()
                handoff = PlanHandoff(x, weights, mailbox.x_t, mailbox.weights_t, mailbox.fids_t,
                                      self._bell(mailbox, layer, n), always, fill_rows, tickets)
            p = plan_layer_device(cache.device_state, layer, ids, cache.policy.fetch_rule, cache.ratio_q16,
                                  tally=counts, handoff=handoff)
            if mailbox is not None and handoff is None:
                bell = self._bell(mailbox, layer, n)
                fills = tickets = None
                if plane.copy_fills:
                    fills = (p.background_slots, p.copy_fids, mailbox.fill_slots_t, mailbox.fill_fids_t)
                    words, landed = plane.fill_ticket_words()
                    tickets = (words, p.copy_slots, landed)
                post_cpu_work(x, weights, ids, p.routes, layer * self.num_experts,
                              mailbox.x_t, mailbox.weights_t, mailbox.fids_t, always=always, fills=fills,
                              tickets=tickets)
                plane.flags.write(*bell)
            plane.stamp(layer, "posted")
            banks = [cache.pool.w13, cache.pool.w2], [cache.w13, cache.w2]
            fill_slots(p.copy_slots, p.copy_fids, *banks)
            plane.stamp(layer, "filled")
            # (landing: the fill was launched just before, so routes to other slots may start early)
            y = self.gemms[layer](x, weights, p.routes, cache.w13, cache.w2, landing=p.copy_slots)
            plane.stamp(layer, "computed")
            if mailbox is not None:
                # the CPU answers by echoing the bell value into the done word
                done = (mailbox.address(DONE), Mailbox.bell_value(layer, n))
                if fused:  # (with copy-engine fills the CPU queues them once the answer was read: ack)
                    y = add_cpu_result(y, mailbox.out_t, done=done, routes=p.routes, always=always,
                                       ack=mailbox.address(ACK) if plane.copy_fills else None)
                else:
                    plane.flags.wait_geq(*done)
                    y = add_cpu_result(y, mailbox.out_t)
            plane.stamp(layer, "merged")
            if cache.policy.fetch_rule is FetchRule.QSTAR_BACKGROUND and not plane.copy_fills:
                # The step's stream fills them, after the layer's CPU answer: a fill started with
                # the plan would compete with that layer's CPU experts and GEMM for the link and SMs.
                fill_slots(p.background_slots, p.copy_fids, *banks)
            return y
