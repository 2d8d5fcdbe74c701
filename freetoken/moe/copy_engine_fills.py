"""The host's half of hybrid's background fills through the copy engine in captured decode
steps: whether the copy engine can take them at all, per step whether its layers hand them over
and whether its start waits for the last step's, and settling or restarting them around work
outside captured steps. The CPU poller queues the copies (kernels/cpu/copy_engine.py); the
device numbers them (moe/fill_tickets.py).
"""

from __future__ import annotations

import logging

from freetoken.moe.fill_tickets import FillTickets

log = logging.getLogger(__name__)


def copy_fill_schedule(num_slots: int, moe_layers: int, top_k: int, rows: int, pending_rows: int) -> tuple[bool, bool]:
    """For a step of `rows` where hybrid's background fills can go to the copy engine: (whether
    its post kernels hand them over, whether its start waits for every fill numbered so far).
    pending_rows: the rows of the last step if it handed fills over (0 if not, or settled since).
    Victims are the least recently used slots, so no layer takes a slot still being filled while
    the slots outnumber the routes that can have touched slots since that fill was planned: this
    step's alone for its own fills (else they stay on the step's stream, and nothing is handed
    over), the last step's and this one's for the last step's fills (else the start waits)."""
    per_row = moe_layers * top_k
    handover = num_slots >= per_row * rows
    return handover, not (handover and num_slots >= per_row * (pending_rows + rows))


class CopyEngineFills:
    def __init__(self, plan, mailbox, tickets: FillTickets, moe_layers: int, top_k: int) -> None:
        self.plan = plan  # kernels/cpu/copy_engine.FillPlan
        self.mailbox = mailbox
        self.tickets = tickets
        self.moe_layers, self.top_k = moe_layers, top_k
        # The rows of the last step if it queued copy-engine fills that may still be landing (0:
        # none). A step that hands fills over waits per slot for those it touches; one that does
        # not (its post kernels take no tickets) waits for all at its start, and so, as a margin,
        # does one whose rows and the last step's outnumber the slots (copy_fill_schedule).
        self.pending_rows = 0

    @classmethod
    def build(cls, slots, mailbox, flags, tickets: FillTickets, moe_layers: int, top_k: int) -> CopyEngineFills | None:
        """The copy engine's fills for captured steps over `slots` (None: no background fills
        here, or the copy engine cannot take them). Where it cannot (the fused hand-off failed
        its self-test, or the driver's functions cannot be had), each layer's background fills
        run on the step's stream after the layer, loudly."""
        from freetoken.reference.fetch_rule import FetchRule

        if mailbox is None or slots.policy.fetch_rule is not FetchRule.QSTAR_BACKGROUND:
            return None
        if flags is not None:  # the fill tickets' waits live in the fused post kernel
            log.warning("background fills: the copy engine needs the fused CPU hand-off; the step's stream "
                        "fills them after each layer")
            return None
        pool = slots.pool
        if slots.w13.dtype != pool.w13.dtype:  # the copy engine moves bytes; the fill kernel widens
            log.warning("background fills: the slots hold %s experts from a %s pool, which the copy engine "
                        "cannot widen; the step's stream fills them after each layer", slots.w13.dtype, pool.w13.dtype)
            return None
        from freetoken.kernels.cpu.copy_engine import FillPlan
        from freetoken.kernels.cpu.doorbell import CHUNK, LANDED

        try:
            plan = FillPlan(mailbox.address(LANDED), mailbox.address(CHUNK), slots.policy.copy_fill_depth)
        except Exception as exc:
            log.error("background fills cannot use the copy engine (%s: %s): the step's stream fills them "
                      "after each layer", type(exc).__name__, exc)
            return None
        return cls(plan, mailbox, tickets, moe_layers, top_k)

    def schedule(self, slots, rows: int, graphs_captured: bool) -> tuple[bool, bool]:
        """Before a step of `rows` over `slots`, before the mailbox is armed: (whether its layers
        hand fills over, whether its start waits for every fill so far)."""
        if self.mailbox.fill_tickets_issued() >= 1 << 30:
            # (rarely) the tickets start over, far from int32's wrap-around and from POISON
            self.settle(slots)
            self.restart_tickets()
        if self.tickets.size(slots.num_slots) and graphs_captured:
            raise RuntimeError("the fill tickets were resized under captured graphs: a resize must invalidate them")
        return copy_fill_schedule(slots.num_slots, self.moe_layers, self.top_k, rows, self.pending_rows)

    def use_banks(self, slots) -> None:
        """After arming: the poller copies between the current banks (a resize moves the slot banks)."""
        self.mailbox.fill_plan = self.plan.use_banks([slots.pool.w13, slots.pool.w2], [slots.w13, slots.w2])

    def leave_stream(self, num_slots: int, rows: int) -> bool:
        """Whether a step of `rows` may run its background fills on through the rest of the step:
        only if no later layer of the step can take their slots as victims (the layer's own fill
        would race them). Victims are the least recently used slots, so that holds when the slots
        outnumber what one step can touch: every MoE layer's routes of every row."""
        return copy_fill_schedule(num_slots, self.moe_layers, self.top_k, rows, 0)[0]

    def settle(self, slots) -> None:
        """Queue the background fills still waiting for the copy engine and wait on the host until
        every one has landed: for work outside captured steps that touches the slots (prefill, a
        resize, shutdown). A fill the driver refused leaves the expert cache emptied, and raises."""
        try:
            self.mailbox.flush_fills()
        except Exception:
            self.restart(slots)
            raise
        self.plan.stream.synchronize()
        self.pending_rows = 0

    def restart(self, slots) -> None:
        """After a failure: what the copy stream was given lands, the tickets start over on both
        sides (the device's count may be ahead of what was queued), and, since fills never queued
        (rings not answered, a queue the abort emptied, a copy refused) leave slots the plans
        count as filled, the expert cache starts empty."""
        self.plan.stream.synchronize()
        self.restart_tickets()
        slots.forget_all()
        log.error("copy-engine fills failed or were cut short: the expert cache starts empty again")

    def restart_tickets(self) -> None:
        """Number copy-engine fills from zero again on both sides; only once the copy stream has
        landed everything it was given."""
        self.mailbox.restart_fill_tickets()
        self.tickets.restart()
        self.pending_rows = 0
