"""The device's half of the copy-engine fill tickets (the kernels that wait and number are in
kernels/triton/fill_tickets.py; the CPU poller's half in kernels/cpu/copy_engine.py).

A captured layer may hand its background fills to the copy engine and go on; a later layer
that touches one of those slots must wait until that fill landed. So every fill gets a ticket:
the array holds, per slot, the ticket of its last fill, then the running count, then the last
LANDED value seen. Graphs hold the array's address, so it is replaced only when every graph was
dropped (a resize).

Shape legend: S slots.
"""

from __future__ import annotations

import torch


class FillTickets:
    def __init__(self, device: str) -> None:
        # [S + 2] int32; sized for the slot cache before every step (`size`): graphs hold its address.
        self.words = torch.zeros(2, dtype=torch.int32, device=device)

    def size(self, num_slots: int) -> bool:
        """Before a step: the tickets array fits a slot cache of `num_slots`. A new size (after a
        resize, which settled every fill and dropped every graph, whose kernels held the old
        array's address) gets fresh per-slot tickets, the counts running on; returns whether
        the array was replaced."""
        if self.words.shape[0] == num_slots + 2:
            return False
        old = self.words
        # (made outside inference mode, which every forward runs in: a restart fills it in place)
        with torch.inference_mode(False):
            # every slot's ticket at the last LANDED value seen: nothing to wait for, whatever the values
            self.words = old[-1:].repeat(num_slots + 2)
            self.words[-2:] = old[-2:]
        return True

    def handoff_words(self, mailbox) -> tuple[torch.Tensor, torch.Tensor]:
        """What a layer's hand-off needs to wait for earlier fills into the slots it touches and
        number its own: the tickets and the LANDED word (int32 [1], pinned host)."""
        from freetoken.kernels.cpu.doorbell import LANDED

        return self.words, mailbox.flags_t[LANDED:LANDED + 1]

    def await_all(self, mailbox) -> None:
        """At a step's start, if the host's WAIT_ALL word says so: wait until the copy engine has
        landed every background fill numbered so far (LANDED reaches the running count; the fused
        hand-off's kind of wait). Nothing of the step reads or refills a slot before that. The
        host asks for it where the step's layers could take a slot still being filled as a victim
        (copy_engine_fills.copy_fill_schedule), and for steps that queue no fills themselves."""
        from freetoken.kernels.cpu.doorbell import LANDED, WAIT_ALL
        from freetoken.kernels.triton.cpu_handoff import wait_word

        count = self.words[self.words.shape[0] - 2:]
        wait_word(mailbox.address(LANDED), count.data_ptr(), mailbox.address(WAIT_ALL))

    def restart(self) -> None:
        """Number fills from zero again (on the current stream), with Mailbox.restart_fill_tickets."""
        self.words.zero_()
