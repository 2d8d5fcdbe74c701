"""The safety argument behind copy-engine fill tickets, checked against the reference policy.

Background fills queued on the copy engine land while later layers, and the next step, run.
Per step the host decides (decode_graphs.copy_fill_schedule) whether its fills go to the copy
engine and whether its start waits for every fill still landing; otherwise each layer waits only
for the tickets of its own earlier fills (tickets are queue positions: a layer's wait lands every
fill queued up to its own last one). What must hold, for any routing: no plan takes a slot still
being filled as a victim (its fill would race the copy), and no plan routes a token to one (it
would read half-copied weights). The model below takes the worst case, that nothing lands
before something waits for it.

It holds even with no start wait at all after a step that handed fills over (the second
schedule below): victims go in least-recently-used order, a step's layers use slots in layer
order, and a layer's ticket wait lands its own and every earlier layer's fills; so a plan reaches
a slot still landing only after every older slot, and the slots outnumber what that takes
whenever both steps could hand fills over. The engine's schedule keeps a margin: its start
waits when the two steps' routes outnumber the slots."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.engine.decode_graphs import copy_fill_schedule
from freetoken.reference.expert_cache import CacheState, plan_layer


@st.composite
def decode_runs(draw):
    layers, experts = draw(st.integers(1, 3)), draw(st.integers(2, 12))
    top_k = draw(st.integers(1, min(4, experts)))
    max_rows = draw(st.integers(1, 4))
    # slots near the bounds that matter: multiples of one row's routes over all layers
    per_row = layers * top_k
    slots = draw(st.integers(1, 2 * max_rows).map(lambda m: per_row * m) | st.integers(1, layers * experts))
    slots = max(1, min(layers * experts, slots + draw(st.integers(-1, 1))))
    ratio = draw(st.sampled_from([1, 21845, 32768, 65535]) | st.integers(1, 65536))
    p_hot = draw(st.sampled_from([0.0, 0.6]))  # uniform routing misses most, exhausting older slots
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    hot = [rng.sample(range(experts), max(1, experts // 3)) for _ in range(layers)]
    steps = []
    for _ in range(draw(st.integers(8, 40))):
        rows = rng.randint(1, max_rows)
        steps.append([[[rng.choice(hot[layer]) if rng.random() < p_hot else rng.randrange(experts)
                        for _ in range(top_k)] for _ in range(rows)] for layer in range(layers)])
    return layers, experts, top_k, slots, ratio, steps


def per_layer_waits_only(slots, layers, top_k, rows, pending_rows):
    handover, _ = copy_fill_schedule(slots, layers, top_k, rows, pending_rows)
    return handover, not handover


@pytest.mark.parametrize("schedule", [copy_fill_schedule, per_layer_waits_only])
@settings(max_examples=150, deadline=None)
@given(run=decode_runs())
def test_no_plan_takes_or_reads_a_slot_still_being_filled(schedule, run):
    layers, experts, top_k, slots, ratio, steps = run
    state = CacheState(layers, experts, slots)
    landing: list[tuple[int, int]] = []  # (layer, slot) of copy-engine fills, in queue order
    pending_rows = 0
    for step, routing in enumerate(steps):
        rows = len(routing[0])
        handover, wait_all = schedule(slots, layers, top_k, rows, pending_rows)
        if wait_all:
            landing.clear()
        for layer, ids in enumerate(routing):
            # the layer's ticket wait: every fill queued up to this layer's last one has landed
            last = max((i for i, (owner, _) in enumerate(landing) if owner == layer), default=-1)
            del landing[:last + 1]
            busy = {slot for _, slot in landing}
            plan = plan_layer(state, layer, ids, "hybrid", ratio, fetch_recurring=True, background=True)
            taken = {slot for slot, _ in plan.copies + plan.background}
            read = {slot for row in plan.routes for slot in row if slot >= 0}
            assert not taken & busy, f"step {step} layer {layer}: victims {taken & busy} are still being filled"
            assert not read & busy, f"step {step} layer {layer}: routes read {read & busy} still being filled"
            if handover:  # (else the fills run in order on the step's stream)
                landing += [(layer, slot) for slot, _ in plan.background]
        pending_rows = rows if handover else 0
