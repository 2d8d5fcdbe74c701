"""The safety argument behind copy-engine fill tickets, checked against the reference policy.

Background fills queued on the copy engine land while later layers, and the next step, run.
Per step the host decides (moe/copy_engine_fills.copy_fill_schedule) whether its fills go to the copy
engine and whether its start waits for every fill still landing. Tickets are queue positions,
so a wait for one lands every fill queued up to it. What must hold, for any routing: no plan
takes a slot still being filled as a victim (its fill would race the copy), and no plan routes
a token to one (it would read half-copied weights). The model below takes the worst case, that
nothing lands before something waits for it. Two wait rules:

- per slot (the engine's, kernels/triton/cpu_handoff.py): a layer waits for the latest ticket
  among the slots its plan touches (routes, copies, background fills), computed here from the
  plan's outputs as the kernel does, so a layer whose slots have landed does not wait;
- per layer (the rule before it): a layer waits for the ticket of its own last fill. It holds
  too, even with no start wait at all after a step that handed fills over: victims go in
  least-recently-used order, a step's layers use slots in layer order, and a layer's ticket
  wait lands its own and every earlier layer's fills; so a plan reaches a slot still landing
  only after every older slot, and the slots outnumber what that takes whenever both steps could
  hand fills over.

The per-slot rule is safe by construction; what it adds over the per-layer one is that quiet
layers stop waiting for fills they do not touch. (It is not always earlier: with the states of
the two rules drifting apart over steps, a layer can touch a slot its own last fill came after.)"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.moe.copy_engine_fills import copy_fill_schedule
from freetoken.reference.expert_cache import CacheState, plan_layer
from freetoken.reference.fetch_rule import FetchRule


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


@pytest.mark.parametrize("rule", ["per_slot", "per_layer"])
@pytest.mark.parametrize("schedule", [copy_fill_schedule, per_layer_waits_only])
@settings(max_examples=150, deadline=None)
@given(run=decode_runs())
def test_no_plan_takes_or_reads_a_slot_still_being_filled(rule, schedule, run):
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
            plan = plan_layer(state, layer, ids, FetchRule.QSTAR_BACKGROUND, ratio)
            taken = {slot for slot, _ in plan.copies + plan.background}
            read = {slot for row in plan.routes for slot in row if slot >= 0}
            # the waits: every fill queued up to the chosen one lands
            own = max((i for i, (owner, _) in enumerate(landing) if owner == layer), default=-1)
            touched = max((i for i, (_, slot) in enumerate(landing) if slot in taken | read), default=-1)
            del landing[:(touched if rule == "per_slot" else own) + 1]
            busy = {slot for _, slot in landing}
            assert not taken & busy, f"step {step} layer {layer}: victims {taken & busy} are still being filled"
            assert not read & busy, f"step {step} layer {layer}: routes read {read & busy} still being filled"
            if handover:  # (else the fills run in order on the step's stream)
                landing += [(layer, slot) for slot, _ in plan.background]
        pending_rows = rows if handover else 0
