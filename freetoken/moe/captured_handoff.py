"""A captured layer's CPU hand-off: how the plan's CPU routes reach the CPU poller through the
mailbox (kernels/cpu/doorbell.py) and how its answer is added back, with no host sync.

Two mechanisms, chosen once per engine by probe (DecodeGraphs._handoff), not by flag:
- fused: the plan kernel posts the rows and rings the bell itself, and the merge kernel waits
  for the answer itself; only where the layer routes to the CPU (or is the step's last MoE
  layer, whose ring ends the poller's step);
- stream flags: where the fused kernels fail their self-test, a post kernel after the plan, then
  stream memory operations write the bell and await the done word.
Policies that never route to the CPU get no hand-off: the plan alone.

Shape legend: N tokens, K top-k, H hidden.
"""

from __future__ import annotations

import torch

from freetoken.moe.background_fills import BackgroundFills


def bell(mailbox, layer: int, rows: int) -> tuple[int, int]:
    """A layer's ring: the bell word's address and the value it stores there."""
    from freetoken.kernels.cpu.doorbell import BELL
    from freetoken.kernels.cpu.mailbox import Mailbox

    return mailbox.address(BELL), Mailbox.bell_value(layer, rows)


def done(mailbox, layer: int, rows: int) -> tuple[int, int]:
    """What the CPU answers: it echoes the bell value into the done word."""
    from freetoken.kernels.cpu.doorbell import DONE
    from freetoken.kernels.cpu.mailbox import Mailbox

    return mailbox.address(DONE), Mailbox.bell_value(layer, rows)


def plan(cache, layer: int, ids: torch.Tensor, counts: torch.Tensor, handoff=None):
    """The device plan of `layer` (counters tallied into `counts`), posting with `handoff`."""
    from freetoken.kernels.triton.plan import plan_layer_device

    return plan_layer_device(cache.device_state, layer, ids, cache.policy.fetch_rule, cache.ratio_device,
                             tally=counts, handoff=handoff)


class NoHandoff:
    """A policy that never routes to the CPU: the plan, nothing to post or add."""

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def plan(self, cache, x, weights, ids, counts, fills: BackgroundFills):
        return plan(cache, self.layer, ids, counts)

    def merge(self, y, p, fills: BackgroundFills) -> torch.Tensor:
        return y


class FusedHandoff:
    """The hand-off kernels ring and wait themselves: the plan kernel posts the layer's CPU work
    and rings, the merge kernel awaits the done word and adds."""

    def __init__(self, mailbox, layer: int, rows: int, always: bool) -> None:
        self.mailbox, self.layer, self.rows, self.always = mailbox, layer, rows, always

    def plan(self, cache, x, weights, ids, counts, fills: BackgroundFills):
        from freetoken.kernels.triton.cpu_handoff import PlanHandoff

        m = self.mailbox
        fill_rows, tickets = fills.fused_rows(m)  # the CPU queues them on the copy engine; the kernel numbers them
        handoff = PlanHandoff(x, weights, m.x_t, m.weights_t, m.fids_t, bell(m, self.layer, self.rows), self.always,
                              fill_rows, tickets)
        return plan(cache, self.layer, ids, counts, handoff)

    def merge(self, y, p, fills: BackgroundFills) -> torch.Tensor:
        from freetoken.kernels.triton.cpu_handoff import add_cpu_result

        # (with copy-engine fills the CPU queues them once the answer was read: ack)
        return add_cpu_result(y, self.mailbox.out_t, done=done(self.mailbox, self.layer, self.rows),
                              routes=p.routes, always=self.always, ack=fills.ack(self.mailbox))


class FlagHandoff:
    """Stream memory operations do the doorbell's flag work: a post kernel after the plan, the
    bell written and the done word awaited by the stream (kernels/stream_flags.py)."""

    def __init__(self, mailbox, flags, layer: int, rows: int, always: bool) -> None:
        self.mailbox, self.flags, self.layer, self.rows, self.always = mailbox, flags, layer, rows, always

    def plan(self, cache, x, weights, ids, counts, fills: BackgroundFills):
        from freetoken.kernels.triton.cpu_handoff import post_cpu_work

        m, layer = self.mailbox, self.layer
        p = plan(cache, layer, ids, counts)
        ring = bell(m, layer, self.rows)
        rows, tickets = fills.posted_rows(p, m)
        post_cpu_work(x, weights, ids, p.routes, layer * cache.pool.config.num_experts, m.x_t, m.weights_t, m.fids_t,
                      always=self.always, fills=rows, tickets=tickets)
        self.flags.write(*ring)
        return p

    def merge(self, y, p, fills: BackgroundFills) -> torch.Tensor:
        from freetoken.kernels.triton.cpu_handoff import add_cpu_result

        self.flags.wait_geq(*done(self.mailbox, self.layer, self.rows))
        return add_cpu_result(y, self.mailbox.out_t)


def handoff_for(plane, routes_to_cpu: bool, layer: int, rows: int):
    """The hand-off `layer` of this step uses, for `rows` tokens (the graph plane: `plane`)."""
    if not routes_to_cpu or plane.mailbox is None:
        return NoHandoff(layer)
    always = layer == plane.last_moe_layer
    if plane.flags is None:
        return FusedHandoff(plane.mailbox, layer, rows, always)
    return FlagHandoff(plane.mailbox, plane.flags, layer, rows, always)
