"""The two planners behind one interface: over the same routed ids they make the same plans and
leave the same state, whatever the fetch rule; forgetting, claiming a layer and replacing the
state agree too. Without a GPU the device planner's kernel runs in Triton's interpreter."""

from __future__ import annotations

import copy
import random
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.moe.planner import DevicePlanner, Planner, ReferencePlanner, make_planner
from freetoken.reference.expert_cache import CacheState, share_q16
from freetoken.reference.fetch_rule import FetchRule

L, E, K = 3, 8, 2


def _planners(num_slots: int) -> tuple[ReferencePlanner, DevicePlanner]:
    state = CacheState(L, E, num_slots)
    for slot in range(num_slots // 2):  # a few experts placed before serving
        state.place(slot, slot)
    return make_planner("reference", state, "cpu"), make_planner("triton", state, "cpu")


def _same_plan(a, b) -> None:
    assert torch.equal(a.routes, b.routes) and torch.equal(a.routes_host, b.routes_host)
    assert a.routes.dtype == b.routes.dtype == torch.int32
    assert (a.copies, a.background, a.hits, a.misses) == (b.copies, b.background, b.hits, b.misses)


@pytest.mark.parametrize("rule", list(FetchRule))
def test_the_planners_plan_alike(rule):
    rng = random.Random(int(rule))
    ref, dev = _planners(num_slots=6)
    ratio = share_q16(0.5)
    for _ in range(12):
        layer = rng.randrange(L)
        ids = torch.tensor([rng.sample(range(E), K) for _ in range(rng.randint(1, 4))], dtype=torch.int64)
        _same_plan(ref.plan(layer, ids, rule, ratio), dev.plan(layer, ids, rule, ratio))
        assert dev.reference_state() == ref.reference_state()
    ref.state.check()


def test_forget_claim_and_replace_agree():
    ref, dev = _planners(num_slots=12)
    ids = torch.tensor([[0, 1], [2, 3]])
    for p in (ref, dev):
        p.plan(1, ids, FetchRule.ALL, 0)
        p.forget_all()
    assert dev.reference_state() == ref.reference_state()
    assert all(s == -1 for s in ref.state.slot_of) and ref.state.step > 0  # recency of routing kept
    for layer, first in [(0, 0), (1, E // 2), (2, 4)]:
        ref.claim_layer(layer, first, first + E)
        dev.claim_layer(layer, first, first + E)
        assert dev.reference_state() == ref.reference_state()
        ref.state.check()
    fresh = CacheState(L, E, 5)
    for p in (ref, dev):
        p.replace_state(fresh)
        assert p.reference_state() == fresh


@settings(max_examples=60, deadline=None)
@given(data=st.data(), extra=st.integers(0, 2 * E), layer=st.integers(0, L - 1), first=st.integers(0, E))
def test_claims_agree_and_keep_the_experts_cached_past_the_buffers(data, extra, layer, first):
    """Any state: both planners claim alike; the layer's experts cached at slots >= keep_from
    stay, every other expert of the layer sits at its buffer slot, and the kept ones' buffer
    slots are empty and first in line for eviction."""
    slots = first + E + extra
    keep_from = data.draw(st.integers(first + E, slots), label="keep_from")
    state = CacheState(L, E, slots)
    for fid, slot in zip(data.draw(st.permutations(range(L * E)), label="fids"),
                         data.draw(st.permutations(range(slots)), label="slots"), strict=False):
        if data.draw(st.booleans(), label="cached"):
            state.place(fid, slot)
            state.last_used[slot] = data.draw(st.integers(1, 9), label="last_used")
    state.step = 10
    ref, dev = make_planner("reference", copy.deepcopy(state), "cpu"), make_planner("triton", state, "cpu")
    assert dev.slot_map() == ref.slot_map() == state.slot_of
    before = list(state.slot_of)
    ref.claim_layer(layer, first, keep_from)
    dev.claim_layer(layer, first, keep_from)
    after = ref.reference_state()
    assert dev.reference_state() == after
    after.check()
    for e in range(E):
        fid, slot = layer * E + e, first + e
        if before[fid] >= keep_from:
            assert after.slot_of[fid] == before[fid] and after.last_used[before[fid]] == after.step
            assert after.fid_of_slot[slot] == -1 and after.last_used[slot] == 0
        else:
            assert after.slot_of[fid] == slot and after.last_used[slot] == after.step
    others = [fid for fid in range(L * E) if fid // E != layer and before[fid] >= keep_from]
    assert all(after.slot_of[fid] == before[fid] for fid in others)  # past the buffers nothing else moves
    with pytest.raises(ValueError, match="past the claimed slots"):
        ref.claim_layer(layer, first, first + E - 1)


def test_make_planner_picks_by_device_and_refuses_unknown_names():
    state = CacheState(L, E, 4)
    assert isinstance(make_planner("auto", state, "cpu"), ReferencePlanner)
    for kind, cls in (("reference", ReferencePlanner), ("triton", DevicePlanner)):
        planner = make_planner(kind, state, "cpu")
        assert isinstance(planner, Planner) and isinstance(planner, cls) and planner.name == kind
    with pytest.raises(ValueError, match="unknown planner"):
        make_planner("numba", state, "cpu")


def test_the_module_imports_without_triton():
    code = "import sys, freetoken.moe.planner; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
