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
def _await_fill_tickets(tickets_ptr, num_slots, routes_ptr, cs_ptr, bg_ptr, P, landed_ptr,
                        BLOCK_P: tl.constexpr, FENCE: tl.constexpr):
    """Wait until LANDED reaches the latest ticket among the slots the layer touches: its routes
    (P entries), the fill kernel's copies and its background fills. LANDED is read from the host
    only when such a ticket is past the last value seen."""
    seen = tl.load(tickets_ptr + num_slots + 1)
    i = tl.arange(0, BLOCK_P)
    ahead = tl.zeros([], dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        m = p0 + i < P
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
    tl.store(tickets_ptr + num_slots + 1, landed)
    tl.debug_barrier()  # every thread's ticket accesses come before what follows


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


def await_fill_tickets_torch(tickets: tuple, routes: torch.Tensor, background: torch.Tensor) -> None:
    """The twin of the wait: tickets = (words [S + 2], copy_slots [P], the LANDED word [1])."""
    words, copy_slots, landed_word = tickets
    num_slots, landed = words.shape[0] - 2, int(landed_word[0])
    seen = int(words[num_slots + 1])
    touched = torch.cat([copy_slots.reshape(-1), background.reshape(-1), routes.reshape(-1)])
    touched = touched[touched >= 0].long()
    ahead = max([wrap_int32(int(t) - seen) for t in words[touched].tolist()], default=0)
    if ahead > 0:
        need = wrap_int32(seen + ahead)
        if wrap_int32(landed - need) < 0:
            raise RuntimeError(f"fill ticket {need} has not landed (LANDED {landed}): the twin cannot wait")
        seen = landed
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
