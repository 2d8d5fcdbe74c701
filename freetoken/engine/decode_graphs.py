"""Decode steps captured in CUDA graphs, the CPU expert branch included.

Shape legend: B sequences in the step, R the captured batch size (B padded up), Lk the key
bucket, V vocab, L layers.

A graph is captured per (R, Lk): R from `batch_sizes` (smaller batches are padded up by
repeating row 0: same token, position and pages, so the padded rows write the very keys row 0
writes and route to the same experts; in a linear-attention layer they read row 0's recurrent
state without writing it and take row 0's output: engine/step_inputs.py), Lk the power of two at
or above the longest sequence (attention masks the padding keys). The first step of a new shape
runs the same code eagerly (that is the real step, and it compiles and warms every kernel), then
the shape is captured without executing; later steps write their inputs into the shape's pinned
buffer, which the graph's first kernel reads (engine/step_inputs.py), and replay.

Inside the graph a MoE layer plans on the device, fills slots from the pinned pool by a
device-side copy plan, and meets the CPU through the doorbell (kernels/cpu/doorbell.py): the
CPU executor's poller answers one ring per MoE layer in compiled code, without the GIL. The
step ends when the poller has answered every ring and the device has drained; a handshake that
stalls past `watchdog_s` fails the step with an error instead of hanging (Mailbox.finish).

Counters (hits, misses, fetched, CPU routes) accumulate on the device; the step's last kernel
stores them, with the stamps, into pinned host memory (GraphPlane.mirror), and `sync_stats` folds
them from there into the slot cache's host counters once the step has ended (padded rows count
like real ones): a step reads nothing back through a copy engine but the sampler's tokens, with
a live split or auto's choice as without. A status read while a step runs reads the device's
counters. Live bandwidths
(cache/live_bandwidth.py) take what is on the host already: a CPU sample per fold (CPU experts
over the poller's answer time), a PCIe sample per step over device stamps (fills between their
layer's `posted` and `filled` points) where the stamps are on: with --trace, or for hybrid's live
split (moe/live_split.py), which also folds the counters after every step so that each step
gives it one sample per link.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import dataclass

import torch

from freetoken.cache.slot_cache import STAT_FIELDS
from freetoken.engine.graph_plane import (
    FILL_POINTS,
    LAYER_PHASES,
    LAYER_POINTS,
    GraphPlane,
    cpu_experts,
    step_fill_timing,
)
from freetoken.engine.step_inputs import StepInputs
from freetoken.moe.copy_engine_fills import CopyEngineFills
from freetoken.reference.fetch_rule import FetchRule
from freetoken.trace import NULL_RECORDER, TraceRecorder

log = logging.getLogger(__name__)

MIN_KEY_BUCKET = 128


def key_bucket(key_len: int) -> int:
    """The attended key length a decode step is padded to (eager and captured steps alike, so
    both run the same attention)."""
    return max(MIN_KEY_BUCKET, 1 << (key_len - 1).bit_length())


def batch_sizes_for(max_rows: int) -> list[int]:
    """Captured batch sizes: powers of two below max_rows, and max_rows itself."""
    sizes, s = [], 1
    while s < max_rows:
        sizes.append(s)
        s *= 2
    return sizes + [max_rows]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph  # starts by reading its StepInputs' pinned buffer
    logits: torch.Tensor  # [R, V], written by each replay
    resident_routes: list[tuple[int, int]]  # what each replay's resident layers route (GraphPlane)


class DecodeGraphs:
    def __init__(self, runner, batch_sizes: list[int], watchdog_s: float,
                 recorder: TraceRecorder = NULL_RECORDER) -> None:
        self.runner = runner
        self.batch_sizes = sorted(batch_sizes)
        self.watchdog_s = watchdog_s
        # cycles the CPU poller spent from seeing a ring to answering it, summed over every
        # step (its stamps): what `cpu_answer_ns` reports
        self.cpu_answer_cycles = 0
        self.trace = recorder
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.inputs: dict[tuple[int, int], StepInputs] = {}  # per shape, captured or not
        # The last step's end: the device reads the pinned inputs and the mailbox while a step
        # runs, so the next step rewrites them only after it (a no-op wait where the caller read
        # the logits on the host first, as the scheduler does; a caller that feeds tokens of its
        # own without reading them would otherwise race the step still running).
        self.last_step_end: torch.cuda.Event | None = None
        self.pool = torch.cuda.graph_pool_handle()
        cfg = runner.model_config
        self.moe_layers = cfg.num_sparse_layers
        # the bell's layer field of the step's last MoE layer: it always rings, and ends the step
        self.last_ring = max(i for i, sparse in enumerate(cfg.sparse_layers) if sparse) + 1
        self.flags = None
        self.mailbox = None
        if runner.slots.policy.routes_to_cpu:
            from freetoken.kernels.cpu.doorbell import CycleClock
            from freetoken.kernels.cpu.mailbox import Mailbox

            self.flags = self._handoff()
            # (the executor compiles its poller for it at the first serve, before that step runs)
            self.mailbox = Mailbox(self.batch_sizes[-1], cfg.top_k, cfg.hidden_size, pinned=True,
                                   layers=self.moe_layers)
            self.clock = CycleClock()
        self.plane = GraphPlane(cfg.num_layers, runner.device, self.mailbox, self.flags, self.last_ring - 1)
        # hybrid's background fills through the copy engine (None: on the step's stream, or none)
        self.copy_engine = CopyEngineFills.build(runner.slots, self.mailbox, self.flags, self.plane.tickets,
                                                 self.moe_layers, cfg.top_k)
        self.device_clock = None
        self._counts_before: list[list[int]] | None = None  # the counters as the step started (with stamps)
        self._stepping = False  # a step is launched and its end not yet seen: the mirror is behind
        # hybrid's live split (moe/live_split.py) wants both links timed every step
        self.per_step_samples = runner.live_split is not None
        if self.trace.enabled or self.per_step_samples:
            self._enable_stamps(cfg.num_layers)
        self.live, self._answer_ns_folded, self._live_lock = runner.model.backend.live, 0, threading.Lock()
        self.live.sources = {"pcie_fill": ("captured steps: in-layer fills over their device stamps, per step"
                                           if self.plane.stamps is not None else "captured steps: not timed "
                                           "(device stamps only with --trace or a live split)")
                                          + "; eager forwards: per layer",
                             "cpu_expert": "captured steps: CPU experts folded over the poller's ring-to-answer "
                                           f"time, per {'step' if self.per_step_samples else 'status read'}; "
                                           "eager forwards: per call"}
        # Shapes whose capture failed: the same capturable code, launched eagerly (logged once).
        self.uncapturable: set[tuple[int, int]] = set()
        self.capture_failures = 0  # over the engine's life (a resize clears `uncapturable`)
        if self.mailbox is None:
            self.mechanism = "none (no CPU branch)"
        else:
            self.mechanism = "fused hand-off kernels" if self.flags is None else self.flags.kind

    def background_filler(self) -> str | None:
        """Who runs the background fills of captured steps: "copy" (the copy engine, queued by the
        CPU poller) or "stream" (the fill kernel on the step's stream, where the copy engine
        cannot take them); None where the policy has none."""
        if self.runner.slots.policy.fetch_rule is not FetchRule.QSTAR_BACKGROUND:
            return None
        return "copy" if self.copy_engine is not None else "stream"

    def settle_fills(self) -> None:
        """Background fills still on their way through the copy engine have landed (for work
        outside captured steps that touches the slots: prefill, a resize, shutdown)."""
        if self.copy_engine is not None:
            self.copy_engine.settle(self.runner.slots)

    @staticmethod
    def _handoff():
        """The stream flags the layers' hand-off uses: None for the fused kernels (they do the
        flag work themselves), else the probed stream-flag mechanism. The fused kernels are
        checked once; where they fail, the stream flags take over, loudly."""
        from freetoken.kernels.stream_flags import StreamFlags
        from freetoken.kernels.triton.cpu_handoff import fused_handoff_self_test

        try:
            fused_handoff_self_test()
            return None
        except Exception as exc:
            log.error("fused CPU hand-off failed its self-test (%s: %s): stream memory operations instead",
                      type(exc).__name__, exc)
        return StreamFlags.probe()

    def _enable_stamps(self, num_layers: int) -> None:
        """Tracing or a live split on: capture device timestamps at each MoE layer's phase
        boundaries (a few microseconds of graph time per stamp launch). Where the device timer cannot be
        read, the trace keeps its step spans and says why it has no layer spans, and captured
        steps give no PCIe samples."""
        from freetoken.kernels.triton.device_clock import DeviceClock

        try:
            self.device_clock = DeviceClock.calibrate(self.runner.device)
        except Exception as exc:
            log.error("device timestamps unavailable (%s: %s): the trace has no per-layer device spans",
                      type(exc).__name__, exc)
            return
        # a live split alone times only the in-layer fills, which the fill kernel stamps itself:
        # no stamp launch in the step (a trace adds 3 a MoE layer)
        self.plane.enable_stamps(LAYER_POINTS if self.trace.enabled else FILL_POINTS)
        log.info("device stamps at %s of each MoE layer (clock offset known to +-%.1f us)",
                 ", ".join(p for p in LAYER_POINTS if p in self.plane.stamp_points),
                 self.device_clock.uncertainty_ns / 1e3)

    def invalidate(self) -> None:
        """Drop every captured graph (the caches they point into were replaced by a resize)."""
        self.sync_stats()
        self.graphs.clear()
        self.uncapturable.clear()
        # A fresh pool: tensors the dropped graphs returned keep theirs alive with no owner, and
        # capturing into such a pool trips the caching allocator's assert.
        self.pool = torch.cuda.graph_pool_handle()

    def sync_stats(self, at_step_end: bool = False) -> None:
        """Bring the slot cache's host counters up to date with the device's: from the pinned
        mirror where the last step is known to have ended (`at_step_end`: its caller saw the
        end), else from the device."""
        with self._live_lock:  # (status reads may come from several threads)
            ended = at_step_end or not self._stepping and (self.last_step_end is None or self.last_step_end.query())
            counts = self.plane.host_counts() if ended else None
            experts = cpu_experts(self.plane.fold_into(self.runner.slots.stats, counts))
            answer_ns, before = self.cpu_answer_ns(), self._answer_ns_folded
            self._answer_ns_folded = answer_ns
            if experts > 0:
                self.live.cpu_expert.add(experts * self.runner.pool.expert_bytes, answer_ns - before)

    def decode(self, page_tables: list[list[int]], tokens: list[int], positions: list[int],
               state_slots: list[int] | None = None) -> torch.Tensor:
        """One token for each of B sequences -> logits [B, V] (state_slots: each sequence's
        recurrent-state slot, for models with linear-attention layers)."""
        b = len(tokens)
        rows = next((r for r in self.batch_sizes if r >= b), None)
        if rows is None:
            raise ValueError(f"a decode batch of {b} exceeds the largest captured batch {self.batch_sizes[-1]}")
        pad = rows - b
        page_tables = page_tables + page_tables[:1] * pad
        tokens, positions = tokens + tokens[:1] * pad, positions + positions[:1] * pad
        bucket = key_bucket(max(positions) + 1)
        runner = self.runner
        inputs = self.inputs.get((rows, bucket))
        if inputs is None:
            inputs = self.inputs[(rows, bucket)] = StepInputs(rows, bucket, runner.device)
        if self.last_step_end is not None:
            self.last_step_end.synchronize()
        if (state_slots is None) != (runner.states is None):
            raise ValueError("a model with linear-attention layers needs each sequence's state slot, and only it")
        inputs.fill(tokens, positions, page_tables, runner.cache.page_size, state_slots)
        if runner.routing is not None:
            runner.routing.stage(b, rows, runner.device)
        ticket = None
        copy_fills, wait_all = False, True
        if self.copy_engine is not None:
            copy_fills, wait_all = self.copy_engine.schedule(runner.slots, rows, bool(self.graphs))
        if self.mailbox is not None:
            # Arming clears the done word, so the last step's device waits must be past (they
            # are: decode waited for the last step's end above).
            self.mailbox.arm(handover=copy_fills, wait_all=wait_all)
            if self.copy_engine is not None:  # (a resize moves the slot banks)
                self.copy_engine.use_banks(runner.slots)
        if self.plane.stamps is not None:  # (the last step has ended: decode waited for it above)
            self._counts_before = self.plane.host_counts()
        captured = self.graphs.get((rows, bucket))
        with self._live_lock:
            self._stepping = True
        try:
            if captured is None:
                ticket = self._serve()
                logits = self._uncaptured_step(rows, bucket, inputs, ticket)
            else:
                # The poller is queued last, just before the replay: its worker wakes and runs
                # Python (argument set-up) until its compiled loop lets the GIL go, and any torch
                # call in between, releasing the GIL, would hand it to the worker and wait for it
                # back. The device reaches the first ring only after the first layer's attention.
                ticket = self._serve()
                start = self._step_event()
                captured.graph.replay()
                self._finish(ticket, start, rows)
                self.plane.add_resident(captured.resident_routes)
                logits = captured.logits
        except BaseException:
            if ticket is not None and not ticket.done():  # stop the poller this step armed
                self.mailbox.cancel(ticket, self.watchdog_s)
            if self.copy_engine is not None:
                self.copy_engine.restart(runner.slots)
            with self._live_lock:
                self._stepping = False
            raise
        if self.copy_engine is not None:
            self.copy_engine.pending_rows = rows if copy_fills else 0
        logits = logits[:b].clone()
        end = torch.cuda.Event()
        end.record()
        with self._live_lock:  # (from its end on, the mirror holds this step's counters)
            self.last_step_end, self._stepping = end, False
        return logits

    def _serve(self):
        """Queue the CPU poller for this step's rings (None without a CPU branch)."""
        if self.mailbox is None:
            return None
        return self.runner.executor.serve(self.mailbox, self.last_ring, self.moe_layers)

    def _forward(self, inputs: StepInputs, bucket: int) -> torch.Tensor:
        """The step through the capturable code paths (they are switched on only for it: prefill
        and eager forwards keep their own), starting with its inputs read from the pinned buffer."""
        backend, routing = self.runner.model.backend, self.runner.routing
        backend.graph_plane = self.plane
        if routing is not None:
            routing.use_staged = True
        try:
            inputs.upload()
            if routing is not None:
                routing.upload_staged()
            # the step's background fills go to the copy engine, or stay on its stream, in order
            engine = self.copy_engine
            self.plane.copy_fills = engine is not None and engine.leave_stream(self.runner.slots.num_slots, inputs.rows)
            if engine is not None:  # (whether it waits, the host says before each step: Mailbox.arm)
                self.plane.tickets.await_all(self.mailbox)
            self.plane.resident_routes = []
            kv = inputs.kv_view(self.runner.cache, self.runner.states)
            logits = self.runner.model.forward(inputs.tokens, inputs.positions, kv, bucket)
            self.plane.mirror()  # the step's last kernel: its counters and stamps into pinned memory
            return logits
        finally:
            backend.graph_plane = None
            if routing is not None:
                routing.use_staged = False

    def _uncaptured_step(self, rows, bucket, inputs: StepInputs, ticket) -> torch.Tensor:
        """Run the step eagerly through the capturable code (the real step; it also compiles
        and warms every kernel), then capture the shape for later steps. The eager step reads
        the very input buffers the graph will: Triton specialises kernels on pointer alignment,
        and a kernel compiled anew inside the capture invalidates it."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self._forward(inputs, bucket)
        self.plane.add_resident(self.plane.resident_routes)
        torch.cuda.current_stream().wait_stream(side)
        self._finish(ticket, None, rows)
        if (rows, bucket) in self.uncapturable:
            return logits
        torch.cuda.synchronize()
        capture_started = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        # No garbage collection inside the capture: an object freed there (a dropped runner's
        # events, stream-recorded blocks, pinned buffers) makes CUDA calls that invalidate it.
        # (torch.cuda.graph collects on entry; a collection later in the capture is the risk.)
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._forward(inputs, bucket)
        except Exception as exc:  # this step's logits stand; the shape stays eager, loudly
            self.uncapturable.add((rows, bucket))
            self.capture_failures += 1
            log.error("decode graph capture failed for batch %d, keys %d (%s: %s): this shape runs eagerly",
                      rows, bucket, type(exc).__name__, exc)
            return logits
        finally:
            if gc_was_enabled:
                gc.enable()
        self.graphs[(rows, bucket)] = _Captured(graph, out, self.plane.resident_routes)
        log.info("captured decode graph: batch %d, keys %d (%.0f ms; CPU doorbell: %s)", rows, bucket,
                 (time.perf_counter() - capture_started) * 1e3, self.mechanism)
        return logits

    def _step_event(self) -> tuple[torch.cuda.Event, int] | None:
        """With tracing on: a timed CUDA event at the step's start, and the host time then."""
        if not self.trace.enabled:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event, time.perf_counter_ns()

    def _finish(self, ticket, start: tuple[torch.cuda.Event, int] | None, rows: int) -> None:
        """Wait for the CPU branch (with the watchdog); trace the step's device time and the
        doorbell's CPU spans."""
        end = torch.cuda.Event(enable_timing=start is not None)
        end.record()
        if ticket is not None:
            self.mailbox.finish(ticket, end.query, self.watchdog_s)
            stamps = ticket.out  # [rings, 3]: cycles at the ring, when answered, layer + 1 (0: no ring)
            self.cpu_answer_cycles += int((stamps[:, 1] - stamps[:, 0]).sum())
            if self.trace.enabled:
                self._trace_doorbell(ticket.out)
        if start is not None:
            event, host_ns = start
            end.synchronize()
            device_ns = int(event.elapsed_time(end) * 1e6)
            self.trace.complete("gpu_runner", "graph_step", host_ns, host_ns + device_ns, batch=rows)
        if self.plane.stamps is not None or self.per_step_samples:
            end.synchronize()  # (the mirror holds this step's counters and stamps)
        if self.plane.stamps is not None:
            self._time_layers()
        if self.per_step_samples:
            self.sync_stats(at_step_end=True)  # (the step's CPU sample)

    def cpu_answer_ns(self) -> int:
        """Nanoseconds the CPU branch took to answer rings (ring seen to answer written), summed
        over every captured step so far; 0 without a CPU branch."""
        return self.clock.duration_ns(self.cpu_answer_cycles) if self.mailbox is not None else 0

    def _time_layers(self) -> None:
        """The step's in-layer fills as a PCIe sample and, with tracing on, the step's MoE layers
        on the device: one span per phase (LAYER_PHASES) with the layer's fetched experts and CPU
        routes of this step, and the span between layers (attention, norms, router)."""
        counts, stamps = self.plane.host_counts(), self.plane.host_stamps()
        before = self._counts_before or [[0] * len(row) for row in counts]
        gained = [[a - b for a, b in zip(row, seen, strict=True)] for row, seen in zip(counts, before, strict=True)]
        experts, fill_ns = step_fill_timing(stamps, gained)
        if experts and fill_ns > 0:  # (odd stamps give no sample, never a failed step)
            self.live.pcie_fill.add(experts * self.runner.pool.expert_bytes, fill_ns)
        if not self.trace.enabled:
            return
        to_host = self.device_clock.to_host_ns
        fetched, later, cpu = (STAT_FIELDS.index(f) for f in ("fetched", "background", "cpu_routes"))
        previous_end = None
        for layer, (points, row) in enumerate(zip(stamps, gained, strict=True)):
            if points[0] == 0:  # a dense layer: no MoE stamps
                continue
            if previous_end is not None:
                self.trace.complete("gpu_layers", "between_layers", to_host(previous_end), to_host(points[0]),
                                    layer=layer)
            for name, a, b in zip(LAYER_PHASES, points, points[1:], strict=False):
                self.trace.complete("gpu_layers", name, to_host(a), to_host(b), layer=layer,
                                    fetched=row[fetched], background=row[later], cpu_routes=row[cpu])
            previous_end = points[-1]

    def _trace_doorbell(self, stamps) -> None:
        for rang, answered, layer in stamps.tolist():
            if layer == 0:  # a ring that never came: its layer had no CPU routes
                continue
            self.trace.complete("cpu_executor", "doorbell_cpu_moe", self.clock.to_ns(rang),
                                self.clock.to_ns(answered), layer=layer - 1)
