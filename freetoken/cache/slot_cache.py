"""The GPU slot cache shared by all MoE layers, and its planner.

Shape legend: S slots, L layers, E experts, I expert intermediate, H hidden, N tokens, K top-k.
    w13 [S, 2I, H], w2 [S, H, I] in the compute dtype, on the compute device
    (torch CPU tensors stand in for the GPU when there is none, so CI runs this path).

The banks are resizable rows (cache/resizable_rows.py): a live resize changes the slot count in
place, committing only new slots or giving the tail back, so it never needs a second cache's
memory beside the first.

Decisions come from the cache's planner (moe/planner.py): on CUDA the Triton plan kernel keeps
the state on the device; elsewhere the Python twin runs the same plan over lists. Either way the
result is a LayerPlan: routes as slot ids (-1 = CPU) and the (slot, fid) copies to fill from the
host pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby
from typing import TYPE_CHECKING

import torch

from freetoken.cache.host_pool import HostExpertPool
from freetoken.cache.resizable_rows import ResizableRows, resize_together
from freetoken.moe.planner import LayerPlan, Planner, make_planner
from freetoken.moe.policy import Policy
from freetoken.reference.expert_cache import CacheState

if TYPE_CHECKING:
    from freetoken.kernels.device_cache_state import DeviceCacheState


STAT_FIELDS = ("hits", "misses", "fetched", "background", "cpu_routes", "routed")


@dataclass
class CacheStats:
    """Counters since start, per MoE layer, in STAT_FIELDS order. A plan counts distinct
    experts (hits, misses, fetched: over PCIe; background: of those, the ones filled for later
    steps, which this step computes on the CPU) and routes (cpu_routes, routed); `resident`
    runs no plan and counts every route as a hit."""

    hits: list[int] = field(default_factory=list)
    misses: list[int] = field(default_factory=list)
    fetched: list[int] = field(default_factory=list)
    background: list[int] = field(default_factory=list)
    cpu_routes: list[int] = field(default_factory=list)
    routed: list[int] = field(default_factory=list)

    @classmethod
    def zeros(cls, num_layers: int) -> CacheStats:
        return cls(*([0] * num_layers for _ in STAT_FIELDS))

    def add(self, layer: int, *values: int) -> None:
        """Add one plan's (or a fold's) counts, in STAT_FIELDS order."""
        if len(values) != len(STAT_FIELDS):
            raise ValueError(f"expected {len(STAT_FIELDS)} counts ({', '.join(STAT_FIELDS)}), got {len(values)}")
        for name, value in zip(STAT_FIELDS, values, strict=True):
            getattr(self, name)[layer] += value

    def hit_rate(self) -> float:
        looked_up = sum(self.hits) + sum(self.misses)
        return sum(self.hits) / looked_up if looked_up else 0.0


def initial_placement(pool: HostExpertPool, policy: Policy, num_slots: int) -> list[tuple[int, int]]:
    """(slot, fid) pairs placed before serving: the experts of the layers the policy places."""
    cfg = pool.config
    sparse = [layer for layer in range(cfg.num_layers) if cfg.sparse_layers[layer]]
    E = cfg.num_experts
    fids = [layer * E + e for layer in policy.gpu_layers(sparse, num_slots, E) for e in range(E)]
    return list(enumerate(fids))


class SlotCache:
    def __init__(
        self, pool: HostExpertPool, num_slots: int, policy: Policy, ratio_q16: int, device: str, dtype: torch.dtype,
        planner: str = "auto",
    ) -> None:
        cfg = pool.config
        L, E = cfg.num_layers, cfg.num_experts
        self.pool = pool
        self.policy = policy
        self._check_size(num_slots)
        # hybrid's split, on the host for eager plans and in a device word captured plans read
        # when they run (kernels/triton/plan.py), so a live split reaches replayed graphs
        self.ratio_device = torch.zeros(1, dtype=torch.int32, device=device)
        self.set_ratio_q16(ratio_q16)
        self.num_slots = num_slots
        self.device = device
        # room for every expert; memory only for the slots in use
        # The pool's expert format fixes each bank's rows and the dtype the slots hold them in.
        self.banks = [ResizableRows(1, L * E, bank.row_shape, pool.format.slot_dtype(dtype), device, num_slots)
                      for bank in pool.format.banks(cfg)]
        self._view_banks()
        self.stats = CacheStats.zeros(L)
        state = CacheState(L, E, num_slots)
        placed = initial_placement(pool, policy, num_slots)
        # resident: layer l's experts sit at slots base[l] .. base[l]+E-1, so routes need no plan
        self.resident_base = {fid // E: slot for slot, fid in placed if fid % E == 0} if policy.every_expert else {}
        for slot, fid in placed:
            state.place(fid, slot)
        self.fill(placed)
        self.planner: Planner = make_planner(planner, state, device)

    def set_ratio_q16(self, ratio_q16: int) -> None:
        """The PCIe share of the split from the next plan on (Q16, 0..65536). On a CUDA device the
        word is written on the current stream, the stream the next captured step runs on."""
        if not 0 <= ratio_q16 <= 65536:
            raise ValueError(f"the split's Q16 share must be in 0..65536, got {ratio_q16}")
        self.ratio_q16 = int(ratio_q16)
        self.ratio_device.fill_(self.ratio_q16)

    def _view_banks(self) -> None:
        self.w13 = self.banks[0].tensor[0]  # [S, 2I, H]
        self.w2 = self.banks[1].tensor[0]  # [S, H, I]

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes

    @property
    def state(self) -> CacheState:
        """The reference planner's live state (the device planner has `device_state` instead)."""
        return self.planner.state

    @property
    def device_state(self) -> DeviceCacheState:
        """The device planner's live state, what captured layers plan over."""
        return self.planner.device_state

    def reference_state(self) -> CacheState:
        return self.planner.reference_state()

    def forget_all(self) -> None:
        """Mark every slot empty (their bytes can no longer be trusted), keeping the recency of
        routing; later plans fetch again. In place: captured graphs keep pointing at the state."""
        self.planner.forget_all()

    def committed_bytes(self, num_slots: int) -> int:
        """The device memory the banks take at `num_slots` slots."""
        return sum(bank.committed_bytes(num_slots) for bank in self.banks)

    @property
    def min_slots(self) -> int:
        """A cache smaller than a layer's experts leaves the routes it cannot slot to the CPU
        kernel: where that kernel does not compute the pool's format, a layer's experts must fit."""
        return 1 if self.pool.format.cpu_executable or self.policy.every_expert else self.pool.config.num_experts

    def _check_size(self, num_slots: int) -> None:
        if num_slots < self.min_slots:
            why = "" if self.min_slots == 1 else (
                f" (a layer's experts: the CPU kernel does not compute {self.pool.format.name} experts, so no route "
                "may be left to it)")
            raise ValueError(f"the expert cache needs at least {self.min_slots} slots{why}, got {num_slots}")

    def resize(self, num_slots: int) -> None:
        """Change the slot count in place. Growing commits only the new slots (empty; a refusal
        raises torch.OutOfMemoryError and changes nothing). Shrinking keeps the most recently
        used experts: those in slots past the new end move into slots whose experts are
        dropped, then the tail's memory is given back. Recency and counters run on; fixed
        placements (`static`) are placed again for the new size. The caller makes sure no step
        is in flight and no captured graph still reads the old slot count."""
        self._check_size(num_slots)
        if self.policy.every_expert and num_slots != self.num_slots:
            raise ValueError(f"policy {self.policy.name!r} keeps every expert in its own slot: no resize")
        cfg = self.pool.config
        old = self.reference_state()
        state = CacheState(cfg.num_layers, cfg.num_experts, num_slots)
        moves: list[tuple[int, int]] = []  # (from slot, to slot)
        placed = initial_placement(self.pool, self.policy, num_slots)
        if self.policy.fixed_placement:
            for slot, fid in placed:
                state.place(fid, slot)
        else:
            held = [(fid, old.last_used[slot]) for slot, fid in enumerate(old.fid_of_slot) if fid >= 0]
            kept = sorted(held, key=lambda x: -x[1])[:num_slots]
            kept_fids = {fid for fid, _ in kept}
            holes = [slot for slot in range(min(num_slots, old.num_slots))[::-1]
                     if old.fid_of_slot[slot] not in kept_fids]
            for fid, used in kept:
                slot = old.slot_of[fid]
                if slot >= num_slots:
                    moves.append((slot, holes.pop()))
                    slot = moves[-1][1]
                state.place(fid, slot)
                state.last_used[slot] = used
            state.step, state.last_active = old.step, list(old.last_active)
        if num_slots > self.banks[0].rows:
            self._resize_banks(num_slots)  # (first: a refusal leaves everything as it was)
        for src, dst in moves:  # device to device, no temporary
            self.w13[dst].copy_(self.w13[src])
            self.w2[dst].copy_(self.w2[src])
        if num_slots < self.banks[0].rows:
            self._resize_banks(num_slots)
        self.num_slots = num_slots
        self.planner.replace_state(state)
        if self.policy.fixed_placement:
            self.fill(placed)

    def _resize_banks(self, rows: int) -> None:
        resize_together(self.banks, rows)
        self._view_banks()

    def plan(self, layer: int, ids: torch.Tensor) -> LayerPlan:
        """Plan one layer for routed ids [N, K] (expert indices within the layer)."""
        plan = self.planner.plan(layer, ids, self.policy.fetch_rule, self.ratio_q16)
        cpu_routes = int((plan.routes_host < 0).sum())
        self.stats.add(layer, plan.hits, plan.misses, len(plan.copies) + len(plan.background),
                       len(plan.background), cpu_routes, plan.routes_host.numel())
        return plan

    def claim_layer(self, layer: int, first_slot: int, keep_from: int) -> None:
        """Record that slots first_slot.. first_slot+E-1 now hold every expert of `layer`, in
        order (prefill streaming puts whole layers there), but for those cached at slots >=
        keep_from, which stay there; they count as used now, so the decode cache keeps them."""
        self.planner.claim_layer(layer, first_slot, keep_from)

    def slot_map(self) -> list[int]:
        """The slot holding each fid, or -1, on the host."""
        return self.planner.slot_map()

    def fill_layer(self, layer: int, first_slot: int, slot_of: list[int], keep_from: int) -> int:
        """Copy all of a layer's experts into consecutive slots (async on CUDA, on the current
        stream): those `slot_of` places at slots >= keep_from from there, device to device; the
        rest from the host pool, one copy per bank and run of consecutive experts. Returns how
        many came from the host."""
        E = self.pool.config.num_experts
        base = layer * E
        from_host = 0
        for kept, run in groupby(range(E), key=lambda e: slot_of[base + e] >= keep_from):
            run = list(run)
            if kept:
                for e in run:
                    self.w13[first_slot + e].copy_(self.w13[slot_of[base + e]], non_blocking=True)
                    self.w2[first_slot + e].copy_(self.w2[slot_of[base + e]], non_blocking=True)
                continue
            dest, host = slice(first_slot + run[0], first_slot + run[-1] + 1), slice(base + run[0], base + run[-1] + 1)
            self.w13[dest].copy_(self.pool.w13[host], non_blocking=True)
            self.w2[dest].copy_(self.pool.w2[host], non_blocking=True)
            from_host += len(run)
        return from_host

    def fill(self, copies: list[tuple[int, int]]) -> None:
        """Copy planned experts from the host pool into their slots (async on CUDA, on the current stream)."""
        for slot, fid in copies:
            self.w13[slot].copy_(self.pool.w13[fid], non_blocking=True)
            self.w2[slot].copy_(self.pool.w2[fid], non_blocking=True)
