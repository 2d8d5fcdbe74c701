"""The expert cache state as device tensors: what the plan kernel reads and updates.

Shape legend: L layers, E experts per layer, S slots; fid = layer * E + expert.
Same fields and meaning as `freetoken.reference.expert_cache.CacheState` (the specification);
only the container differs. `step` is a one-element device tensor, bumped by the plan kernel
itself, so a plan never needs the host and a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.reference.expert_cache import CacheState


@dataclass
class DeviceCacheState:
    num_layers: int
    num_experts: int
    num_slots: int
    slot_of: torch.Tensor  # [L*E] int32, slot holding fid or -1
    fid_of_slot: torch.Tensor  # [S] int32, fid held by a slot or -1
    last_used: torch.Tensor  # [S] int64, step of the last hit or fill; 0 = never
    last_active: torch.Tensor  # [L*E] int64, step at which the expert was last routed; 0 = never
    step: torch.Tensor  # [1] int64, plans so far

    @classmethod
    def empty(cls, num_layers: int, num_experts: int, num_slots: int,
              device: torch.device | str = "cpu") -> DeviceCacheState:
        """A cache with every slot empty."""
        return cls.from_reference(CacheState(num_layers, num_experts, num_slots), device)

    @classmethod
    def from_reference(cls, ref: CacheState, device: torch.device | str = "cpu") -> DeviceCacheState:
        def t(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            num_layers=ref.num_layers,
            num_experts=ref.num_experts,
            num_slots=ref.num_slots,
            slot_of=t(ref.slot_of, torch.int32),
            fid_of_slot=t(ref.fid_of_slot, torch.int32),
            last_used=t(ref.last_used, torch.int64),
            last_active=t(ref.last_active, torch.int64),
            step=t([ref.step], torch.int64),
        )

    def to_reference(self) -> CacheState:
        """A host copy (synchronises with the device)."""
        return CacheState(
            num_layers=self.num_layers,
            num_experts=self.num_experts,
            num_slots=self.num_slots,
            slot_of=self.slot_of.tolist(),
            fid_of_slot=self.fid_of_slot.tolist(),
            last_used=self.last_used.tolist(),
            last_active=self.last_active.tolist(),
            step=int(self.step.item()),
        )

    @property
    def device(self) -> torch.device:
        return self.slot_of.device
