"""Fill tickets in the fused hand-off (kernels/triton/cpu_handoff.py) on hand-picked layers,
kernel against twin under Triton's interpreter: a layer waits for the latest ticket among the
slots its routes read, its copies refill and its background fills take (each alone holds it
in one case), and numbers its background fills after the running count."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels.triton import cpu_handoff
from freetoken.kernels.triton.cpu_handoff import post_cpu_work, post_cpu_work_torch

SLOTS = 16


def run(post, routes, copies, background, tickets, landed, seen=0):
    n, k = routes.shape
    x = torch.arange(n * 8, dtype=torch.float32).view(n, 8).to(torch.bfloat16)
    weights = torch.full((n, k), 0.5, dtype=torch.bfloat16)
    ids = torch.arange(n * k, dtype=torch.int32).view(n, k)
    mx, mw = torch.zeros(n, 8), torch.zeros(n, k)
    mf, ms, mc = (torch.full((n, k), -7, dtype=torch.int32) for _ in range(3))
    words = torch.tensor(tickets + [max(tickets), seen], dtype=torch.int32)
    fids = torch.where(background >= 0, 900, -1).to(torch.int32)
    routes = routes.clone()
    post(x, weights, ids, routes, 0, mx, mw, mf, bell=(torch.zeros(1, dtype=torch.int32), 5), always=False,
         fills=(background, fids, ms, mc), tickets=(words, copies, torch.tensor([landed], dtype=torch.int32)))
    return routes, words, mf


def both(*args, **kw):
    kernel, twin = run(post_cpu_work, *args, **kw), run(post_cpu_work_torch, *args, **kw)
    for a, b in zip(kernel, twin, strict=True):
        assert torch.equal(a, b), (a, b)
    return kernel


@pytest.mark.parametrize("chunk", [1024, 2])  # (2: the plan's 12 entries in six chunks)
def test_background_fills_take_the_next_tickets(chunk, monkeypatch):
    monkeypatch.setattr(cpu_handoff, "MAX_BLOCK_P", chunk)
    tickets = [0] * SLOTS
    tickets[3], tickets[5], tickets[7] = 9, 4, 12  # LANDED at 12: every slot landed
    routes = torch.tensor([[3, 5, 7, 1], [3, 2, 7, -1], [3, 4, 5, 6]], dtype=torch.int32)
    background = torch.full((12,), -1, dtype=torch.int32)
    background[7] = 10  # the CPU-routed entry's expert fills slot 10 in the background
    none = torch.full((12,), -1, dtype=torch.int32)
    new_routes, words, mf = both(routes, none, background, tickets, landed=12)
    assert torch.equal(new_routes, routes)
    assert int(words[-1]) == 12  # the LANDED value the layer saw
    assert int(words[10]) == 13  # the background fill's ticket: the next after the count (12)
    assert torch.equal(mf, torch.where(routes < 0, torch.arange(12, dtype=torch.int32).view(3, 4), -1))


def test_nothing_late_reads_no_landed_word():
    tickets = [2] * SLOTS
    routes = torch.tensor([[3, 5]], dtype=torch.int32)
    none = torch.full((2,), -1, dtype=torch.int32)
    new_routes, words, _ = both(routes, none, none, tickets, landed=6, seen=2)
    assert torch.equal(new_routes, routes)
    assert int(words[-1]) == 2  # LANDED was not read: no ticket was past the last value seen


def test_refilled_slots_are_waited_for():
    tickets = [0] * SLOTS
    tickets[3], tickets[9] = 5, 5  # both landed at LANDED 5: the copy's slot 9 is waited for (passes)
    routes = torch.tensor([[3, 9, -1]], dtype=torch.int32)  # (the background fill's expert runs on the CPU)
    copies = torch.tensor([-1, 9, -1], dtype=torch.int32)
    background = torch.tensor([-1, -1, 11], dtype=torch.int32)
    new_routes, words, _ = both(routes, copies, background, tickets, landed=5)
    assert torch.equal(new_routes, routes)
    assert int(words[11]) == 6  # the background fill's ticket: the next after the count (5)


@pytest.mark.parametrize("source", ["routes", "copies", "background"])
def test_each_kind_of_touched_slot_is_waited_for(source):
    tickets = [1] * SLOTS  # every slot landed by the last LANDED value seen (1)...
    routes = torch.tensor([[3, 4, -1]], dtype=torch.int32)
    copies = torch.tensor([-1, 9, -1], dtype=torch.int32)  # (a slot no route names, so that it alone holds it)
    background = torch.tensor([-1, -1, 8], dtype=torch.int32)
    tickets[{"routes": 3, "copies": 9, "background": 8}[source]] = 5  # ...but this one, which LANDED (6) passed
    *_, words, _ = both(routes, copies, background, tickets, landed=6, seen=1)
    assert int(words[-1]) == 6  # the layer read LANDED: it waited for that slot
