"""The two planners behind one interface: over the same routed ids they make the same plans and
leave the same state, whatever the fetch rule; forgetting, claiming a layer and replacing the
state agree too. Without a GPU the device planner's kernel runs in Triton's interpreter."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

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
        ref.claim_layer(layer, first)
        dev.claim_layer(layer, first)
        assert dev.reference_state() == ref.reference_state()
        ref.state.check()
    fresh = CacheState(L, E, 5)
    for p in (ref, dev):
        p.replace_state(fresh)
        assert p.reference_state() == fresh


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
