"""What a captured decode step's MoE layers share on the device: the CPU doorbell's flags, the
counters that stand in for the host's, the copy-engine fill tickets, and (with
tracing on) device timestamps at each layer's phase boundaries. `DecodeGraphs`
(engine/decode_graphs.py) sets it on the model's MoE backend for the steps it captures.

The counters and stamps live in one device buffer that each step's last kernel (`mirror`,
captured in the step's graph) stores into pinned host memory: once the step has ended, the host
reads them there, without a device-to-host copy, which another process's copies can hold up.

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
# The points the slot fill stamps itself (its start and end, kernels/triton/slot_fill.py): a stamp
# launch on either side would end the programmatic chain from the plan through the fill into the
# slot GEMM, and the live split times the fill every step.
FILL_POINTS = ("posted", "filled")
_FILL_AT = LAYER_POINTS.index(FILL_POINTS[0])
assert LAYER_POINTS[_FILL_AT : _FILL_AT + 2] == FILL_POINTS  # (one [2] view of a layer's row)


class GraphPlane:
    """What a MoE layer needs to run without the host: the doorbell, device counters and, with
    tracing on, device timestamps at the layer's phase boundaries (`stamps` [L, LAYER_POINTS])."""

    def __init__(self, num_layers: int, device: str, mailbox=None, flags=None, last_moe_layer: int = -1) -> None:
        self.mailbox = mailbox
        self.flags = flags  # None: the fused hand-off (kernels/triton/cpu_handoff.py)
        self.last_moe_layer = last_moe_layer  # its ring ends the poller's step, CPU routes or not
        fields, points = len(STAT_FIELDS), len(LAYER_POINTS)
        # counters [L, STAT_FIELDS] then stamps [L, LAYER_POINTS], each part contiguous
        self._words = torch.zeros(num_layers * (fields + points), dtype=torch.int64, device=device)
        self.counts = self._words[: num_layers * fields].view(num_layers, fields)
        self.stamps: torch.Tensor | None = None  # `enable_stamps`
        self.stamp_points: frozenset[str] = frozenset()
        self._stamp_words = self._words[num_layers * fields :].view(num_layers, points)
        # the mirror (on the CPU the words themselves: nothing to copy)
        cuda = self._words.is_cuda
        self._host = torch.zeros(self._words.shape, dtype=torch.int64, pin_memory=True) if cuda else self._words
        self._folded = [[0] * fields for _ in range(num_layers)]  # the part of `counts` already folded
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

    def enable_stamps(self, points: tuple[str, ...] = LAYER_POINTS) -> None:
        """Take device timestamps at each MoE layer's phase boundaries from the next capture on:
        at `points` (LAYER_POINTS names; a trace takes them all, the live split only the fill's
        two). The fill's two the fill kernel stores itself (`fill_stamps`); each other stamp is a
        launch in the captured step. Points not taken stay 0."""
        unknown = set(points) - set(LAYER_POINTS)
        if unknown:
            raise ValueError(f"unknown stamp points {sorted(unknown)}: expected some of {LAYER_POINTS}")
        self.stamp_points = frozenset(points)
        self.stamps = self._stamp_words

    def mirror(self) -> None:
        """Queue the store of the counters and stamps into pinned host memory on the current
        stream: the last kernel of a step (captured with it). `host_counts` and `host_stamps`
        hold them once the step has ended."""
        if self._host is not self._words:
            from freetoken.kernels.triton.host_read import write_host

            write_host(self._words, self._host)

    def host_counts(self) -> list[list[int]]:
        """The counters as of the last ended step's `mirror` (on the CPU: now), [L][STAT_FIELDS]."""
        return self._host[: self.counts.numel()].view(self.counts.shape).tolist()

    def host_stamps(self) -> list[list[int]]:
        """The stamps as of the last ended step's `mirror`, [L][LAYER_POINTS] (zeros: a layer
        without stamps)."""
        return self._host[self.counts.numel() :].view(self._stamp_words.shape).tolist()

    def fold_into(self, stats, counts: list[list[int]] | None = None) -> list[int]:
        """Add what the device counters (and the host's count of resident routes) gained since
        the last call to `stats` (CacheStats); return the gain summed over layers, in
        STAT_FIELDS order. `counts`: the counters as the host has them already (the mirror of a
        step that has ended); None reads the device. The counters only grow, so a status read
        from another thread while a step runs loses nothing: that step's counts arrive with the
        next call; and a read older than one folded before adds nothing."""
        gained_total = [0] * len(STAT_FIELDS)
        with self._fold_lock:
            if counts is None:
                counts = self.counts.tolist()
            for layer, (row, seen) in enumerate(zip(counts, self._folded, strict=True)):
                if row != seen:
                    now = [max(a, b) for a, b in zip(row, seen, strict=True)]
                    gained = [a - b for a, b in zip(now, seen, strict=True)]
                    stats.add(layer, *gained)
                    gained_total = [a + b for a, b in zip(gained_total, gained, strict=True)]
                    self._folded[layer] = now
            for layer, routes in enumerate(self._resident_pending):
                if routes:
                    stats.add(layer, routes, 0, 0, 0, 0, routes)  # every route a hit
                    gained_total[0] += routes
                    gained_total[-1] += routes
            self._resident_pending = [0] * len(self._resident_pending)
        return gained_total

    def count_resident(self, layer: int, routes: int) -> None:
        """While a forward is traced: a resident layer of it routes `routes` (all hits)."""
        self.resident_routes.append((layer, routes))

    def add_resident(self, recorded: list[tuple[int, int]]) -> None:
        """A forward ran (eagerly or replayed) whose resident layers recorded `recorded`."""
        with self._fold_lock:
            for layer, routes in recorded:
                self._resident_pending[layer] += routes

    def fill_stamps(self, layer: int) -> torch.Tensor | None:
        """Where `layer`'s slot fill stores its start and end (FILL_POINTS: a [2] view of its
        stamps), or None where those points are not taken."""
        if self.stamps is None or FILL_POINTS[0] not in self.stamp_points:
            return None
        return self.stamps[layer, _FILL_AT : _FILL_AT + 2]

    def stamp(self, layer: int, first: str, last: str | None = None) -> None:
        """Record the device time the stream reaches point `first` (through `last`: consecutive
        points of one instant, a phase this layer skips) of `layer`; nothing with stamps off or
        where `first` is not a point taken."""
        if self.stamps is not None and first in self.stamp_points:
            from freetoken.kernels.triton.device_clock import stamp

            i = LAYER_POINTS.index(first)
            count = (LAYER_POINTS.index(last) if last else i) - i + 1
            stamp(self.stamps, layer * len(LAYER_POINTS) + i, count)


def cpu_experts(gained: list[int]) -> int:
    """Distinct experts computed on the CPU in counts gained (STAT_FIELDS order): the misses not
    filled for this step (fetched less background: those are filled for later steps, and this
    step computes them on the CPU)."""
    misses, fetched, background = (gained[STAT_FIELDS.index(f)] for f in ("misses", "fetched", "background"))
    return misses - fetched + background


def step_fill_timing(points: list[list[int]], gained: list[list[int]]) -> tuple[int, int]:
    """(experts, device ns) of one step's in-layer slot fills: per MoE layer that filled any, its
    `posted` to `filled` stamps (LAYER_POINTS, device ns; a row of zeros: a layer with no stamps)
    and what it fetched for this step (its counts gained, STAT_FIELDS order, less background
    fills, which run outside that phase)."""
    posted, filled = LAYER_POINTS.index("posted"), LAYER_POINTS.index("filled")
    fetched, background = STAT_FIELDS.index("fetched"), STAT_FIELDS.index("background")
    experts = ns = 0
    for stamps, row in zip(points, gained, strict=True):
        now = row[fetched] - row[background]
        if stamps[posted] == 0 or stamps[filled] == 0 or now <= 0:
            continue
        experts += now
        ns += stamps[filled] - stamps[posted]
    return experts, ns
