"""What a captured decode step's MoE layers share on the device: the CPU doorbell's flags, the
counters that stand in for the host's, the copy-engine fill tickets, and (with
tracing on) device timestamps at each layer's phase boundaries. `DecodeGraphs`
(engine/decode_graphs.py) sets it on the model's MoE backend for the steps it captures.

Shape legend: L layers.
"""

from __future__ import annotations

import threading

import torch

from freetoken.cache.slot_cache import STAT_FIELDS
from freetoken.moe.fill_tickets import FillTickets

# A MoE layer's device timestamps (with tracing on): the points between its phases.
LAYER_POINTS = ("start", "posted", "filled", "computed", "merged")
# The spans between consecutive points, named for what runs in them.
LAYER_PHASES = ("plan_post", "fill", "gemm", "wait_cpu")


class GraphPlane:
    """What a MoE layer needs to run without the host: the doorbell, device counters and, with
    tracing on, device timestamps at the layer's phase boundaries (`stamps` [L, LAYER_POINTS])."""

    def __init__(self, num_layers: int, device: str, mailbox=None, flags=None, last_moe_layer: int = -1) -> None:
        self.mailbox = mailbox
        self.flags = flags  # None: the fused hand-off (kernels/triton/cpu_handoff.py)
        self.last_moe_layer = last_moe_layer  # its ring ends the poller's step, CPU routes or not
        self.stamps: torch.Tensor | None = None
        self.counts = torch.zeros(num_layers, len(STAT_FIELDS), dtype=torch.int64, device=device)
        self._folded = [[0] * len(STAT_FIELDS) for _ in range(num_layers)]  # the part of `counts` already folded
        self._fold_lock = threading.Lock()
        # `resident` layers run no plan, so their counts are known on the host: what a forward
        # of them adds (recorded while it is traced, `count_resident`), and what replays of
        # captured forwards added and `fold_into` has not yet folded.
        self.resident_routes: list[tuple[int, int]] = []
        self._resident_pending = [0] * num_layers
        # This step's background fills go to the copy engine: the post kernel hands them to the
        # CPU poller with the layer's CPU work (kernels/cpu/copy_engine.py) and numbers them; a
        # later layer waits for the tickets of the slots it touches before it uses them. False:
        # the step's stream fills them in order, after each layer (DecodeGraphs._forward says when).
        self.copy_fills = False
        # The copy-engine fill tickets (moe/fill_tickets.py): graphs hold their array's address.
        self.tickets = FillTickets(device)

    def fold_into(self, stats) -> None:
        """Add what the device counters (and the host's count of resident routes) gained since
        the last call to `stats` (CacheStats). The device counters only grow, so a status read
        from another thread while a step runs loses nothing: that step's counts arrive with the
        next call."""
        with self._fold_lock:
            counts = self.counts.tolist()
            for layer, (row, seen) in enumerate(zip(counts, self._folded, strict=True)):
                if row != seen:
                    stats.add(layer, *(a - b for a, b in zip(row, seen, strict=True)))
            self._folded = counts
            for layer, routes in enumerate(self._resident_pending):
                if routes:
                    stats.add(layer, routes, 0, 0, 0, 0, routes)  # every route a hit
            self._resident_pending = [0] * len(self._resident_pending)

    def count_resident(self, layer: int, routes: int) -> None:
        """While a forward is traced: a resident layer of it routes `routes` (all hits)."""
        self.resident_routes.append((layer, routes))

    def add_resident(self, recorded: list[tuple[int, int]]) -> None:
        """A forward ran (eagerly or replayed) whose resident layers recorded `recorded`."""
        with self._fold_lock:
            for layer, routes in recorded:
                self._resident_pending[layer] += routes

    def stamp(self, layer: int, first: str, last: str | None = None) -> None:
        """Record the device time the stream reaches point `first` (through `last`: consecutive
        points of one instant, a phase this layer skips) of `layer`; nothing with tracing off."""
        if self.stamps is not None:
            from freetoken.kernels.triton.device_clock import stamp

            i = LAYER_POINTS.index(first)
            count = (LAYER_POINTS.index(last) if last else i) - i + 1
            stamp(self.stamps, layer * len(LAYER_POINTS) + i, count)
