"""Background fills run off the decode step's stream only when the cache has at least one slot
for every route of the step (DecodeGraphs._forward). That rests on a property of the plan:
with S >= L * N * K, no layer of a forward takes as a victim a slot that an earlier layer of
the same forward read or filled, so a fill still running cannot be overwritten or read within
its step. Checked here on the specification for every policy; and the bound is tight enough
to matter: with fewer slots the property fails."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.reference.expert_cache import CacheState, plan_layer
from freetoken.reference.fetch_rule import FetchRule


def _forwards(state: CacheState, rng: random.Random, forwards: int, rows: int, k: int, rule: FetchRule,
              ratio: int) -> bool:
    """Plan `forwards` decode steps (every layer in order); True if no step's plan ever took a
    slot an earlier layer of that step had touched."""
    for _ in range(forwards):
        touched: set[int] = set()
        for layer in range(state.num_layers):
            ids = [rng.sample(range(state.num_experts), k) for _ in range(rows)]
            plan = plan_layer(state, layer, ids, rule, ratio)
            filled = {slot for slot, _ in plan.copies + plan.background}
            if filled & touched:
                return False
            touched |= filled | {s for row in plan.routes for s in row if s >= 0}
    return True


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 4), experts=st.integers(4, 16), rows=st.integers(1, 3), k=st.integers(1, 4),
       extra=st.integers(0, 8), rule=st.sampled_from(list(FetchRule)),
       ratio=st.sampled_from([0, 20000, 32768, 65536]), seed=st.integers(0, 2**31))
def test_a_step_never_refills_a_slot_it_touched(layers, experts, rows, k, extra, rule, ratio, seed):
    k = min(k, experts)
    slots = layers * rows * k + extra  # the bound DecodeGraphs checks
    state = CacheState(layers, experts, slots)
    assert _forwards(state, random.Random(seed), 12, rows, k, rule, ratio)


def test_the_property_needs_the_bound():
    """One slot fewer than a step's routes and a later layer reuses an earlier layer's slot."""
    layers, experts, rows, k = 3, 16, 2, 2
    state = CacheState(layers, experts, layers * rows * k - 1)
    assert not _forwards(state, random.Random(0), 4, rows, k, FetchRule.ALL, 0)
