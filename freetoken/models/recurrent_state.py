"""The recurrent-state pool of linear-attention layers, beside the KV pool: a fixed-size slot per
running sequence, holding for every linear layer what that layer carries from token to token.

Shape legend: L linear layers, S slots, C conv channels, W conv width, HV value heads,
DK key dim, DV value dim.

Unlike KV pages a sequence's state does not grow with its length, and it cannot be cut at an
arbitrary token: a slot holds the state after the sequence's last fed token. A sequence takes a
zeroed slot when it starts and gives it back when it ends; the step's KVView names each row's
slot (`state_slots`), so the blocks read and update the rows of the pool in place.
"""

from __future__ import annotations

import torch

from freetoken.config import ModelConfig
from freetoken.models.layer_kinds import linear_layers


class RecurrentStatePool:
    def __init__(self, num_linear_layers: int, num_slots: int, conv_channels: int, conv_width: int,
                 value_heads: int, key_dim: int, value_dim: int, device: str,
                 dtype: torch.dtype = torch.float32) -> None:
        """dtype: the conv state's (the compute dtype: it holds the layer's inputs); the delta
        rule's state is float32 whatever the compute dtype, as the references keep it."""
        if num_slots < 1:
            raise ValueError(f"a recurrent-state pool needs at least one slot, got {num_slots}")
        self.conv = torch.zeros(num_linear_layers, num_slots, conv_channels, conv_width - 1, dtype=dtype,
                                device=device)  # [L, S, C, W-1]: each sequence's last W-1 conv inputs
        self.ssm = torch.zeros(num_linear_layers, num_slots, value_heads, key_dim, value_dim, dtype=torch.float32,
                               device=device)  # [L, S, HV, DK, DV]
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @classmethod
    def for_model(cls, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: str) -> RecurrentStatePool:
        la = config.linear_attention
        if la is None:
            raise ValueError(f"{config.arch} has no linear-attention layers, so no recurrent state")
        return cls(len(linear_layers(config)), num_slots, la.conv_channels, la.conv_width, la.value_heads,
                   la.key_dim, la.value_dim, device, dtype)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes

    @property
    def free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        """A slot for a new sequence, zeroed (a fresh sequence's state)."""
        if not self._free:
            raise RuntimeError(f"every one of the {self.num_slots} recurrent-state slots is held")
        slot = self._free.pop()
        self.reset(slot)
        return slot

    def reset(self, slot: int) -> None:
        """Zero a slot: the state before a sequence's first token."""
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()

    def snapshot(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of a slot's state in host memory (conv [L, C, W-1], ssm [L, HV, DK, DV]): an anchor's."""
        return self.conv[:, slot].to("cpu", copy=True), self.ssm[:, slot].to("cpu", copy=True)

    def load(self, slot: int, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Put a snapshot back into a slot: the sequence goes on from where the saved one was."""
        conv, ssm = saved
        self.conv[:, slot].copy_(conv)
        self.ssm[:, slot].copy_(ssm)

    @property
    def slot_bytes(self) -> int:
        """One sequence's whole state: what a snapshot takes."""
        return self.nbytes // self.num_slots

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"recurrent-state slot {slot} is not held")
        self._free.append(slot)
