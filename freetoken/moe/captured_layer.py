"""The captured executor of a MoE layer's plan: no host synchronisation, so a decode graph can
capture it (engine/decode_graphs.py sets the graph plane for the steps it captures). The same
kernels and rounding as the eager layer (moe/eager_layer.py); counters stay on the device
(GraphPlane.counts).

Shape legend: N tokens, K top-k, H hidden.

One layer, each phase stamped on the device with tracing on (GraphPlane.stamp; the fill's start
and end, which the live split times every step too, by the fill kernel itself):
 1. the device plan, the CPU routes posted to the mailbox and the bell rung (the hand-off,
    moe/captured_handoff.py; background fills handed to the copy engine with them,
    moe/background_fills.py);
 2. the planned fills, by the device-driven slot fill;
 3. the slot GEMM (its routes to slots still filling wait for them: `landing`);
 4. the CPU's answer awaited and added;
 5. background fills on the step's stream, where the copy engine does not take them.
Resident layers skip all but 3 (moe/resident_layer.py).
"""

from __future__ import annotations

import torch

from freetoken.moe.background_fills import BackgroundFills
from freetoken.moe.captured_handoff import handoff_for
from freetoken.moe.resident_layer import captured_resident
from freetoken.moe.slot_gemm import GemmFn
from freetoken.trace import TraceRecorder


class CapturedLayer:
    def __init__(self, gemms: list[GemmFn], recorder: TraceRecorder) -> None:
        self.gemms = gemms
        self.trace = recorder

    def run(self, cache, plane, layer: int, x: torch.Tensor, weights: torch.Tensor,
            ids: torch.Tensor) -> torch.Tensor:
        """One layer over `cache` (a SlotCache) with what the step's layers share (`plane`, a
        GraphPlane)."""
        from freetoken.kernels.triton.slot_fill import fill_slots

        if cache.resident_base:
            return captured_resident(plane, cache, layer, x, weights, ids, self.gemms[layer])
        plane.stamp(layer, "start")
        counts = plane.counts[layer]  # STAT_FIELDS: hits, ..., routed
        with self.trace.span("gpu_runner", "capture_layer", layer=layer):
            handoff = handoff_for(plane, cache.policy.routes_to_cpu, layer, ids.shape[0])
            fills = BackgroundFills(plane, cache.policy.fetch_rule)
            p = handoff.plan(cache, x, weights, ids, counts, fills)
            banks = [cache.pool.w13, cache.pool.w2], [cache.w13, cache.w2]
            # (the fill stamps its own start and end, "posted" and "filled": no launch between
            # the plan, the fill and the GEMM)
            fill_slots(p.copy_slots, p.copy_fids, *banks, stamps=plane.fill_stamps(layer))
            # (landing: the fill was launched just before, so routes to other slots may start early)
            y = self.gemms[layer](x, weights, p.routes, cache.w13, cache.w2, landing=p.copy_slots)
            plane.stamp(layer, "computed")
            y = handoff.merge(y, p, fills)
            plane.stamp(layer, "merged")
            fills.after_layer(p, banks)
            return y
