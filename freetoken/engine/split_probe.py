"""What a captured decode step tells the adaptive split, read without a synchronisation.

Shape legend: L layers, F the counter fields (STAT_FIELDS), P a layer's stamp points (LAYER_POINTS).

Per MoE layer of the step: the experts the CPU computed (misses less the fills the layer waited
for: the device counters' gain over the step) against the time the CPU poller took from the
layer's ring to its answer (its cycle stamps, on the host already); and the experts the layer's
fill kernel copied (the waited-for fills) against the device time between its `posted` and
`filled` stamps. The counters' gain and the stamps reach the host by an asynchronous copy into
pinned memory queued after the step, read once its event has completed (a later step, as a
rule): nothing waits for them.

Not measured: the copy engine's background fills (their time is known only to the copy stream;
queried, it would need a sync per fill), so a step whose fills all run in the background
observes the PCIe path not at all, and its estimate holds until a layer waits for a fill again.
"""

from __future__ import annotations

import numpy as np
import torch

from freetoken.cache.slot_cache import STAT_FIELDS
from freetoken.engine.graph_plane import LAYER_POINTS, GraphPlane

_MISSES, _FETCHED, _BACKGROUND = (STAT_FIELDS.index(f) for f in ("misses", "fetched", "background"))
_POSTED, _FILLED = LAYER_POINTS.index("posted"), LAYER_POINTS.index("filled")
_BUFFERS = 2  # host copies in flight: one step's may still be landing while the next is queued


class SplitProbe:
    """Feeds a captured step's CPU and PCIe timings to `timings` (moe/live_split.py SplitTimings)."""

    def __init__(self, plane: GraphPlane, timings, expert_bytes: int, clock) -> None:
        self.plane = plane
        self.timings = timings
        self.expert_bytes = expert_bytes
        self.clock = clock  # the poller's CycleClock (None without a CPU branch)
        device = plane.counts.device
        if plane.stamps is None:  # tracing off: only the two points the fill times need
            plane.stamps = torch.zeros(plane.counts.shape[0], len(LAYER_POINTS), dtype=torch.int64, device=device)
            plane.stamped = frozenset(("posted", "filled"))
        self._before = plane.counts.clone()
        self._gain = torch.zeros_like(plane.counts)
        pin = device.type == "cuda"
        self._free = [(torch.zeros(self._gain.shape, dtype=torch.int64, pin_memory=pin),
                       torch.zeros(plane.stamps.shape, dtype=torch.int64, pin_memory=pin)) for _ in range(_BUFFERS)]

    def after_step(self, ring_stamps: np.ndarray | None) -> None:
        """Queued after a step's kernels (on the current stream): the step's counter gain and
        stamps to the host. ring_stamps: the poller's [rings, 3] (ring cycles, answer cycles,
        layer + 1; 0: no ring), None without a CPU branch."""
        torch.sub(self.plane.counts, self._before, out=self._gain)
        self._before.copy_(self.plane.counts)
        if not self._free:  # both copies still landing: this step goes unmeasured
            return
        buffers = self._free.pop()
        gain, stamps = buffers
        gain.copy_(self._gain, non_blocking=True)
        stamps.copy_(self.plane.stamps, non_blocking=True)
        landed = torch.cuda.Event() if gain.is_pinned() else None
        if landed is not None:
            landed.record()
        answer_s = {}
        if ring_stamps is not None and self.clock is not None:
            for rang, answered, layer in ring_stamps.tolist():
                if layer > 0:
                    answer_s[layer - 1] = self.clock.duration_ns(answered - rang) / 1e9

        def resolve() -> bool:
            if landed is not None and not landed.query():
                return False
            self._record(gain.tolist(), stamps.tolist(), answer_s)
            self._free.append(buffers)
            return True

        self.timings.defer(resolve)

    def _record(self, gain: list[list[int]], stamps: list[list[int]], answer_s: dict[int, float]) -> None:
        for layer, (row, points) in enumerate(zip(gain, stamps, strict=True)):
            waited = row[_FETCHED] - row[_BACKGROUND]
            on_cpu = row[_MISSES] - waited
            if layer in answer_s and on_cpu > 0:
                self.timings.cpu(on_cpu * self.expert_bytes, answer_s[layer])
            if waited > 0 and points[_FILLED] > points[_POSTED] > 0:
                self.timings.pcie(waited * self.expert_bytes, (points[_FILLED] - points[_POSTED]) / 1e9)
