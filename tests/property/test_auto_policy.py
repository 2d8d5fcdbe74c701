"""What `auto` rests on (reference/auto_policy.py): a hybrid plan at r = 1 is transfer's plan and
at r = 0 cpu's, for every hybrid fetch rule, over any routing and cache state; and the choice
between them moves only past its hysteresis."""

from __future__ import annotations

import copy
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.reference.auto_policy import CPU, ENTER, HYBRID, LEAVE, TRANSFER, choose, word_for
from freetoken.reference.expert_cache import Q16, CacheState, plan_layer
from freetoken.reference.fetch_rule import FetchRule

HYBRID_RULES = [FetchRule.QSTAR, FetchRule.QSTAR_RECURRING, FetchRule.QSTAR_BACKGROUND]


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 3), experts=st.integers(2, 12), extra=st.integers(0, 20), k=st.integers(1, 4),
       rows=st.integers(1, 3), rule=st.sampled_from(HYBRID_RULES), seed=st.integers(0, 2**31))
def test_hybrid_at_the_ends_plans_as_transfer_and_cpu(layers, experts, extra, k, rows, rule, seed):
    k = min(k, experts)
    rng = random.Random(seed)
    slots = max(1, min(layers * experts, experts // 2 + extra))
    for end, pure in ((Q16, FetchRule.ALL), (0, FetchRule.NONE)):
        hybrid, plain = CacheState(layers, experts, slots), CacheState(layers, experts, slots)
        for _ in range(30):
            layer = rng.randrange(layers)
            ids = [rng.sample(range(experts), k) for _ in range(rows)]
            assert plan_layer(hybrid, layer, copy.deepcopy(ids), rule, end) == plan_layer(plain, layer, ids, pure, 0)
            assert hybrid == plain


@given(ratio=st.floats(0.0, 1.0), previous=st.sampled_from([TRANSFER, HYBRID, CPU]))
def test_the_choice_follows_r_with_hysteresis(ratio, previous):
    choice = choose(previous, ratio)
    if ratio >= 1 - ENTER:
        assert choice == TRANSFER
    elif ratio <= ENTER:
        assert choice == CPU
    elif ratio < 1 - LEAVE and ratio > LEAVE:
        assert choice == HYBRID
    elif ratio <= LEAVE:  # the low band: cpu holds once taken, and is not taken from elsewhere
        assert choice == (CPU if previous == CPU else HYBRID)
    else:
        assert choice == (TRANSFER if previous == TRANSFER else HYBRID)
    assert word_for(choice, ratio) == (Q16 if choice == TRANSFER else 0 if choice == CPU else round(ratio * Q16))


def test_bad_choices_are_refused():
    with pytest.raises(ValueError, match="previous"):
        choose("resident", 0.5)
    with pytest.raises(ValueError, match="ratio"):
        choose(HYBRID, 1.5)
