"""Copy-engine fill tickets on the device: the waits and the numbering inside the fused hand-off's
post kernel (kernels/triton/cpu_handoff.py), and their twins.

Shape legend: S slots, P = N*K entries of a layer's plan (routes, copy_slots, background_slots).

  tickets [S + 2] int32 on the device: per slot the ticket of the last background fill into it,
                 then the running count of fills, then the last LANDED value seen. LANDED is an
                 int32 word in pinned host memory: the copy stream writes each landed fill's
                 ticket there, in queue order (kernels/cpu/copy_engine.py), so a ticket landed
                 once (int32)(LANDED - ticket) >= 0.
  wait:          before the layer's work, until LANDED reaches the latest ticket among the slots
                 the layer touches (those its routes read, the fill kernel refills and its
                 background fills take). A layer whose slots have all landed does not wait,
                 whatever else is still landing; LANDED is read from the host only when a touched
                 slot's ticket is past the last value seen.
  reroute:       (optional) routes wait for nothing: a route whose slot has not landed at a
                 fresh look at LANDED goes to the CPU instead (-1), and the plan's counts move
                 (hits to misses, by the distinct slots; the layer's tally, after this kernel,
                 counts the CPU routes from the routes).
  numbering:     the layer's background fills (slot and fid >= 0, in row order) get the next
                 tickets, as the poller does when it queues them.
Twins: `await_fill_tickets_torch` and `number_fills_torch` (LANDED holds still there: a wait
that would block raises instead), equal bit for bit; the `cpu_handoff` spec checks them with the
hand-off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fence_system():
    zero = tl.zeros([1], dtype=tl.int32)
    # every thread's earlier stores reach the system (the host) before what follows
    tl.inline_asm_elementwise("fence.sc.sys; mov.u32 $0, $1;", "=r,r", [zero], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def _ticket_ahead(tickets_ptr, slots_ptr, offs, mask, seen):
    """How far past `seen` the latest ticket of these slots (-1: none) is (int32 difference)."""
    slots = tl.load(slots_ptr + offs, mask=mask, other=-1)
    tickets = tl.load(tickets_ptr + slots, mask=mask & (slots >= 0), other=seen)
    return tl.max(tickets - seen, axis=0)


@triton.jit
def _late_experts(tickets_ptr, routes_ptr, P, landed, BLOCK_P: tl.constexpr):
    """How many distinct slots the routes (P entries) read whose tickets are past `landed`."""
    i = tl.arange(0, BLOCK_P)
    experts = tl.zeros([], dtype=tl.int32)
    for q in range(0, P):
        slot = tl.load(routes_ptr + q)
        ticket = tl.load(tickets_ptr + slot, mask=slot >= 0, other=landed)
        earlier = tl.zeros([], dtype=tl.int32)  # entries before q reading the same slot
        for p0 in range(0, P, BLOCK_P):
            before = p0 + i < q
            earlier += tl.sum((tl.load(routes_ptr + p0 + i, mask=before, other=-1) == slot).to(tl.int32), axis=0)
        experts += ((slot >= 0) & (ticket - landed > 0) & (earlier == 0)).to(tl.int32)
    return experts


@triton.jit
def _await_fill_tickets(tickets_ptr, num_slots, routes_ptr, cs_ptr, bg_ptr, P, landed_ptr, counts_ptr,
                        BLOCK_P: tl.constexpr, REROUTE: tl.constexpr, FENCE: tl.constexpr):
    """Wait until LANDED reaches the latest ticket among the slots the layer touches: its routes
    (P entries), the fill kernel's copies and its background fills. LANDED is read from the host
    only when such a ticket is past the last value seen. REROUTE: routes wait for nothing; a
    route whose slot has not landed at a fresh look at LANDED goes to the CPU instead (-1), and
    the plan's counts (counts_ptr, int32: hits, misses, ...) move those slots from hits to misses."""
    seen = tl.load(tickets_ptr + num_slots + 1)
    i = tl.arange(0, BLOCK_P)
    ahead = tl.zeros([], dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        m = p0 + i < P
        if not REROUTE:
            ahead = tl.maximum(ahead, _ticket_ahead(tickets_ptr, routes_ptr, p0 + i, m, seen))
        ahead = tl.maximum(ahead, _ticket_ahead(tickets_ptr, cs_ptr, p0 + i, m, seen))
        ahead = tl.maximum(ahead, _ticket_ahead(tickets_ptr, bg_ptr, p0 + i, m, seen))
    landed = seen
    if ahead > 0:
        need = seen + ahead
        landed = tl.load(landed_ptr, volatile=True)
        while landed - need < 0:
            landed = tl.load(landed_ptr, volatile=True)
        if FENCE:  # (always on the device; Triton's interpreter has no inline assembly)
            _fence_system()  # no read of the slots moves before the ticket was seen
    if REROUTE:
        pending = tl.zeros([], dtype=tl.int32)
        for p0 in range(0, P, BLOCK_P):
            pending = tl.maximum(pending, _ticket_ahead(tickets_ptr, routes_ptr, p0 + i, p0 + i < P, landed))
        if pending > 0:
            landed = tl.load(landed_ptr, volatile=True)  # what has landed by now
            if FENCE:
                _fence_system()
            # (counted before any store: copies of an entry other threads hold may see it rewritten)
            experts = _late_experts(tickets_ptr, routes_ptr, P, landed, BLOCK_P)
            tl.debug_barrier()
            for p0 in range(0, P, BLOCK_P):
                m = p0 + i < P
                slots = tl.load(routes_ptr + p0 + i, mask=m, other=-1)
                tickets = tl.load(tickets_ptr + slots, mask=m & (slots >= 0), other=landed)
                late = m & (slots >= 0) & (tickets - landed > 0)
                tl.store(routes_ptr + p0 + i, tl.full([BLOCK_P], -1, tl.int32), mask=late)
            if experts > 0:  # (the plan's counts count distinct experts)
                tl.store(counts_ptr, tl.load(counts_ptr) - experts)  # hits
                tl.store(counts_ptr + 1, tl.load(counts_ptr + 1) + experts)  # misses
    tl.store(tickets_ptr + num_slots + 1, landed)
    tl.debug_barrier()  # every thread's ticket and route accesses come before what follows


@triton.jit
def _number_fills(tickets_ptr, num_slots, bg_ptr, cf_ptr, P, BLOCK_P: tl.constexpr):
    """Give the layer's background fills (slot and fid >= 0, in row order) the next tickets, as
    the poller does when it queues them; each fill's slot keeps its ticket."""
    i = tl.arange(0, BLOCK_P)
    total = tl.load(tickets_ptr + num_slots)
    for p0 in range(0, P, BLOCK_P):
        m = p0 + i < P
        slots = tl.load(bg_ptr + p0 + i, mask=m, other=-1)
        fids = tl.load(cf_ptr + p0 + i, mask=m, other=-1)
        fills = ((slots >= 0) & (fids >= 0)).to(tl.int32)
        tl.store(tickets_ptr + slots, total + tl.cumsum(fills, axis=0), mask=fills > 0)
        total += tl.sum(fills, axis=0)
    tl.store(tickets_ptr + num_slots, total)


def await_fill_tickets_torch(tickets: tuple, routes: torch.Tensor, background: torch.Tensor,
                             reroute: torch.Tensor | None = None) -> None:
    """The twin of the wait (and, with `reroute`, the plan's counts [4] int32, the rerouting):
    tickets = (words [S + 2], copy_slots [P], the LANDED word [1]); routes [N, K] is rewritten in
    place where rerouted."""
    words, copy_slots, landed_word = tickets
    num_slots, landed = words.shape[0] - 2, int(landed_word[0])
    seen = int(words[num_slots + 1])
    waited = [copy_slots.reshape(-1), background.reshape(-1)] + ([] if reroute is not None else [routes.reshape(-1)])
    touched = torch.cat(waited)
    touched = touched[touched >= 0].long()
    ahead = max([wrap_int32(int(t) - seen) for t in words[touched].tolist()], default=0)
    if ahead > 0:
        need = wrap_int32(seen + ahead)
        if wrap_int32(landed - need) < 0:
            raise RuntimeError(f"fill ticket {need} has not landed (LANDED {landed}): the twin cannot wait")
        seen = landed
    if reroute is not None:
        flat = routes.view(-1)
        late = [i for i, slot in enumerate(flat.tolist()) if slot >= 0 and wrap_int32(int(words[slot]) - seen) > 0]
        if late:  # (the kernel takes a fresh look at LANDED first: the same word here)
            seen = landed
            late = [i for i in late if wrap_int32(int(words[flat[i]]) - landed) > 0]
            experts = len({int(flat[i]) for i in late})  # (the plan's counts count distinct experts)
            flat[late] = -1
            reroute[0] -= experts
            reroute[1] += experts
    words[num_slots + 1] = seen


def number_fills_torch(words: torch.Tensor, background: torch.Tensor, fids: torch.Tensor) -> None:
    """The twin of the numbering: words [S + 2], the plan's background_slots and copy_fids [P]."""
    num_slots = words.shape[0] - 2
    background, fids = background.reshape(-1), fids.reshape(-1)
    total = int(words[num_slots])
    for slot in background[(background >= 0) & (fids >= 0)].tolist():  # row order, as queued
        total = wrap_int32(total + 1)
        words[slot] = total
    words[num_slots] = total


def wrap_int32(v: int) -> int:
    """v as an int32 holds it (two's complement wrap-around): how the tickets count."""
    return (v + (1 << 31)) % (1 << 32) - (1 << 31)
