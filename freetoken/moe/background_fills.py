"""Where a captured layer's background fills go (hybrid's fills that the layer does not wait
for). With the copy engine, the layer's post hands their rows to the CPU poller, which queues
them once it has read the layer's CPU work (its ack), and the fill tickets order them against
later layers. Without it, the step's stream fills them after the layer's CPU answer: a fill
started with the plan would compete with that layer's CPU experts and GEMM for the link and SMs.

The graph plane's `copy_fills` says which, per step (DecodeGraphs._forward).
"""

from __future__ import annotations

from freetoken.reference.fetch_rule import FetchRule


class BackgroundFills:
    def __init__(self, plane, fetch_rule: FetchRule) -> None:
        self.copy_engine = plane.copy_fills
        self.tickets = plane.tickets
        self.fetch_rule = fetch_rule

    def fused_rows(self, mailbox) -> tuple[tuple | None, tuple | None]:
        """The plan kernel's fill rows and tickets (the fused hand-off: it posts and numbers them
        itself); (None, None) where the copy engine takes none."""
        if not self.copy_engine:
            return None, None
        return (mailbox.fill_slots_t, mailbox.fill_fids_t), self.tickets.handoff_words(mailbox)

    def posted_rows(self, p, mailbox) -> tuple[tuple | None, tuple | None]:
        """The post kernel's fill rows and tickets from plan `p` (the stream-flag hand-off)."""
        if not self.copy_engine:
            return None, None
        words, landed = self.tickets.handoff_words(mailbox)
        return (p.background_slots, p.copy_fids, mailbox.fill_slots_t, mailbox.fill_fids_t), (words, p.copy_slots,
                                                                                              landed)

    def ack(self, mailbox) -> int | None:
        """The ACK word the merge writes once the CPU's answer was read (the poller queues the
        layer's fills then), or None without copy-engine fills."""
        from freetoken.kernels.cpu.doorbell import ACK

        return mailbox.address(ACK) if self.copy_engine else None

    def after_layer(self, p, banks) -> None:
        """The step's stream fills the background slots, after the layer's CPU answer."""
        if self.fetch_rule is FetchRule.QSTAR_BACKGROUND and not self.copy_engine:
            from freetoken.kernels.triton.slot_fill import fill_slots

            fill_slots(p.background_slots, p.copy_fids, *banks)
