"""The planners: who decides, layer by layer, which routed experts hit, which are fetched into
which slots and which go to the CPU, and where that decision's state lives.

Shape legend: S slots, L layers, E experts per layer, N tokens, K top-k; fid = layer * E + expert.

Two planners make the same decisions (reference/expert_cache.py is the specification):
`ReferencePlanner` runs the Python twin over lists on the host; `DevicePlanner` runs the Triton
plan kernel over a DeviceCacheState, so the state never leaves the device and a decode step can
be captured in a CUDA graph. Both answer with a LayerPlan. The slot cache owns the weights and
counts the plans; it asks its planner for everything about the state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from freetoken.reference.expert_cache import CacheState, check_claim, plan_layer
from freetoken.reference.expert_cache import claim_layer as claim_layer_reference
from freetoken.reference.fetch_rule import FetchRule

if TYPE_CHECKING:
    from freetoken.kernels.device_cache_state import DeviceCacheState

PLANNERS = ("reference", "triton")


@dataclass
class LayerPlan:
    routes: torch.Tensor  # [N, K] int32 slot ids, -1 = compute on the CPU (on the compute device)
    routes_host: torch.Tensor  # the same, on the host (the CPU branch reads it)
    copies: list[tuple[int, int]]  # (slot, fid) to fill before the GPU GEMM
    hits: int
    misses: int
    background: list[tuple[int, int]] = field(default_factory=list)  # (slot, fid) filled for later steps

# Routes one plan takes at most. The device plan kernel compares a layer's routes pairwise in one
# program: beyond a decode batch's worth each size compiles for tens of seconds and runs slowly,
# so the eager layer plans longer inputs (short prefill chunks) in token slices of this many routes.
MAX_PLAN_ROUTES = 128


class Planner(ABC):
    """One layer's plan at a time, over a cache state it owns."""

    name: str  # as SlotCache's `planner` argument spells it

    @abstractmethod
    def plan(self, layer: int, ids: torch.Tensor, rule: FetchRule, ratio_q16: int) -> LayerPlan:
        """Plan one layer for routed ids [N, K] (expert indices within the layer); updates the state."""

    @abstractmethod
    def reference_state(self) -> CacheState:
        """The state as the specification's ints (a copy where it lives on the device)."""

    @abstractmethod
    def replace_state(self, state: CacheState) -> None:
        """Plan from `state` on (a resize builds a new one)."""

    @abstractmethod
    def forget_all(self) -> None:
        """Mark every slot empty, keeping the recency of routing. In place: captured graphs keep
        pointing at the state."""

    @abstractmethod
    def claim_layer(self, layer: int, first_slot: int, keep_from: int) -> None:
        """Slots first_slot.. first_slot+E-1 now hold every expert of `layer`, in order, but for
        those cached at slots >= keep_from, which stay there (reference/expert_cache.claim_layer)."""

    @abstractmethod
    def slot_map(self) -> list[int]:
        """slot_of on the host: the slot holding each fid, or -1 (one transfer where it lives on the device)."""


class ReferencePlanner(Planner):
    """The Python twin over a CacheState on the host; routes are copied to `device`."""

    name = "reference"

    def __init__(self, state: CacheState, device: str) -> None:
        self.state = state
        self.device = device

    def plan(self, layer: int, ids: torch.Tensor, rule: FetchRule, ratio_q16: int) -> LayerPlan:
        p = plan_layer(self.state, layer, ids.tolist(), rule, ratio_q16)
        routes_host = torch.tensor(p.routes, dtype=torch.int32)
        return LayerPlan(routes=routes_host.to(self.device), routes_host=routes_host, copies=p.copies,
                         hits=p.hits, misses=p.misses, background=p.background)

    def reference_state(self) -> CacheState:
        return self.state

    def replace_state(self, state: CacheState) -> None:
        self.state = state

    def forget_all(self) -> None:
        s = self.state
        s.slot_of = [-1] * len(s.slot_of)
        s.fid_of_slot = [-1] * s.num_slots
        s.last_used = [0] * s.num_slots

    def claim_layer(self, layer: int, first_slot: int, keep_from: int) -> None:
        claim_layer_reference(self.state, layer, first_slot, keep_from)

    def slot_map(self) -> list[int]:
        return list(self.state.slot_of)


class DevicePlanner(Planner):
    """The Triton plan kernel over a DeviceCacheState on `device` (Triton is imported on first
    use, so machines without it can still import this module)."""

    name = "triton"

    def __init__(self, state: CacheState, device: str) -> None:
        self.device = device
        self.replace_state(state)

    def plan(self, layer: int, ids: torch.Tensor, rule: FetchRule, ratio_q16: int) -> LayerPlan:
        from freetoken.kernels.triton.plan import plan_layer_device

        p = plan_layer_device(self.device_state, layer, ids, rule, ratio_q16)
        # One device-to-host transfer: the eager path needs routes and copies on the host.
        flat = torch.cat([p.routes.flatten(), p.copy_slots, p.copy_fids, p.background_slots, p.counts]).cpu()
        n = p.routes.numel()
        routes_host = flat[:n].view(p.routes.shape)
        slots, fids, later = (flat[i * n : (i + 1) * n].tolist() for i in (1, 2, 3))
        hits, misses, _, _ = flat[4 * n :].tolist()
        copies = [(s, f) for s, f in zip(slots, fids, strict=True) if s >= 0]
        background = [(s, f) for s, f in zip(later, fids, strict=True) if s >= 0]
        return LayerPlan(routes=p.routes, routes_host=routes_host, copies=copies, hits=hits, misses=misses,
                         background=background)

    def reference_state(self) -> CacheState:
        return self.device_state.to_reference()

    def replace_state(self, state: CacheState) -> None:
        from freetoken.kernels.device_cache_state import DeviceCacheState

        self.device_state: DeviceCacheState = DeviceCacheState.from_reference(state, self.device)

    def forget_all(self) -> None:
        s = self.device_state
        s.slot_of.fill_(-1)
        s.fid_of_slot.fill_(-1)
        s.last_used.zero_()

    def claim_layer(self, layer: int, first_slot: int, keep_from: int) -> None:
        s = self.device_state
        E = s.num_experts
        check_claim(E, first_slot, keep_from)
        slots = torch.arange(first_slot, first_slot + E, device=s.device, dtype=torch.int32)
        fids = torch.arange(layer * E, (layer + 1) * E, device=s.device, dtype=torch.int32)
        # Masked indexing syncs with the device; prefill streaming is not captured in a graph.
        home = s.slot_of[fids.long()]
        kept = home >= keep_from  # cached past the buffers: they stay where they are
        previous = s.fid_of_slot[slots.long()]  # fids evicted from the claimed slots
        s.slot_of[previous[previous >= 0].long()] = -1
        moved = home[~kept & (home >= 0)]  # the other experts leave their old slots for the buffer
        s.fid_of_slot[moved.long()] = -1
        s.slot_of[fids[~kept].long()] = slots[~kept]
        s.fid_of_slot[slots.long()] = torch.where(kept, -1, fids)
        s.step += 1
        s.last_used[slots.long()] = torch.where(kept, 0, s.step)
        s.last_used[home[kept].long()] = s.step

    def slot_map(self) -> list[int]:
        return self.device_state.slot_of.tolist()


def make_planner(kind: str, state: CacheState, device: str) -> Planner:
    """kind: "triton", "reference" or "auto" (the device planner on CUDA, the twin elsewhere)."""
    if kind == "auto":
        kind = "triton" if device == "cuda" else "reference"
    if kind == "triton":
        return DevicePlanner(state, device)
    if kind == "reference":
        return ReferencePlanner(state, device)
    raise ValueError(f"unknown planner {kind!r}; expected 'auto' or one of {', '.join(PLANNERS)}")
