"""The live split's twin (reference/split_estimator.py): stable under outliers, converging to the
true share when bandwidths hold still, and following a step change in one of them."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.reference.expert_cache import pcie_share
from freetoken.reference.split_estimator import (
    CONVERGE_STEPS,
    MAX_BPS,
    MIN_BPS,
    TRACK_FACTOR,
    TRACK_STEPS,
    SplitEstimate,
    SplitParams,
    StepTimings,
    prior,
    run,
    step,
)

TOLERANCE = 0.02
P = SplitParams()

bandwidths = st.floats(MIN_BPS, MAX_BPS)
# bytes of one step's path: from one small expert to a layer's worth of big ones
amounts = st.integers(1 << 16, 1 << 31)


def _timings(pcie_bps: float, cpu_bps: float, pcie_bytes: int, cpu_bytes: int) -> StepTimings:
    return StepTimings(pcie_bytes, pcie_bytes / pcie_bps, cpu_bytes, cpu_bytes / cpu_bps)


@st.composite
def estimates(draw) -> SplitEstimate:
    return SplitEstimate(draw(bandwidths), draw(bandwidths), draw(st.floats(0.0, 1.0)), draw(bandwidths),
                         draw(bandwidths), draw(st.integers(0, 99)))


@st.composite
def any_timings(draw) -> StepTimings:
    """Anything a step can report, outliers included: a path unused, nanoseconds, hours."""
    def path():
        if draw(st.booleans()):
            return 0, 0.0
        return draw(st.integers(1, 1 << 40)), draw(st.floats(1e-9, 1e4))

    (pb, ps), (cb, cs) = path(), path()
    return StepTimings(pb, ps, cb, cs)


@settings(max_examples=150, deadline=None)
@given(state=estimates(), timings=any_timings())
def test_one_step_moves_the_ratio_by_at_most_the_bound(state, timings):
    after = step(state, timings)
    assert 0.0 <= after.ratio <= 1.0
    assert abs(after.ratio - state.ratio) <= P.max_step + 1e-12
    # and each estimate by at most clip ** alpha
    bound = math.log(P.clip) * P.alpha + 1e-9
    assert abs(math.log(after.pcie_bps / state.pcie_bps)) <= bound
    assert abs(math.log(after.cpu_bps / state.cpu_bps)) <= bound


@settings(max_examples=100, deadline=None)
@given(true_pcie=bandwidths, true_cpu=bandwidths, prior_pcie=bandwidths, prior_cpu=bandwidths,
       sizes=st.lists(st.tuples(amounts, amounts), min_size=CONVERGE_STEPS, max_size=CONVERGE_STEPS))
def test_fixed_bandwidths_converge_to_the_true_share(true_pcie, true_cpu, prior_pcie, prior_cpu, sizes):
    history = [_timings(true_pcie, true_cpu, pb, cb) for pb, cb in sizes]
    final = run(prior(prior_pcie, prior_cpu), history)
    assert abs(final.ratio - pcie_share(true_pcie, true_cpu)) <= TOLERANCE
    assert final.observed == CONVERGE_STEPS


@settings(max_examples=100, deadline=None)
@given(pcie=bandwidths, cpu=bandwidths, factor=st.floats(1 / TRACK_FACTOR, TRACK_FACTOR), which=st.booleans(),
       outlier=st.floats(1e-3, 1e3), sizes=st.lists(st.tuples(amounts, amounts), min_size=TRACK_STEPS,
                                                    max_size=TRACK_STEPS))
def test_a_step_change_in_one_bandwidth_settles_within_the_bound(pcie, cpu, factor, which, outlier, sizes):
    settled = prior(pcie, cpu)
    # one wild step first (a slow step is not a change of bandwidth): the split barely moves
    jolted = step(settled, _timings(pcie * outlier, cpu, 1 << 20, 1 << 20))
    assert abs(jolted.ratio - settled.ratio) <= P.max_step + 1e-12
    new_pcie, new_cpu = (pcie * factor, cpu) if which else (pcie, cpu * factor)
    history = [_timings(new_pcie, new_cpu, pb, cb) for pb, cb in sizes]
    final = run(jolted, history)
    assert abs(final.ratio - pcie_share(new_pcie, new_cpu)) <= TOLERANCE


def test_a_step_with_no_observation_changes_no_estimate():
    start = SplitEstimate(25e9, 50e9, 0.2, 10e9, 10e9)
    after = step(start, StepTimings())
    assert (after.pcie_bps, after.cpu_bps, after.observed) == (25e9, 50e9, 0)
    assert after.ratio == pytest.approx(0.2 + P.max_step)  # r still walks toward the estimates' share


@settings(max_examples=50, deadline=None)
@given(prior_pcie=bandwidths, cpu=bandwidths, starved=bandwidths)
def test_a_path_the_split_stopped_using_relaxes_to_its_prior(prior_pcie, cpu, starved):
    """PCIe measured slow once, then never used again while the CPU path runs: its estimate
    goes back to the profile's, so the split tries PCIe again."""
    state = SplitEstimate(starved, cpu, pcie_share(starved, cpu), prior_pcie, cpu)
    cpu_only = [StepTimings(cpu_bytes=1 << 20, cpu_s=(1 << 20) / cpu)] * 400
    final = run(state, cpu_only)
    assert abs(math.log(final.pcie_bps / prior_pcie)) < 0.02
    assert abs(final.ratio - pcie_share(prior_pcie, cpu)) <= TOLERANCE


@pytest.mark.parametrize("timings, message", [
    (dict(pcie_bytes=-1), "pcie"), (dict(cpu_bytes=5, cpu_s=0.0), "cpu: 5 B moved in no time"),
    (dict(pcie_bytes=1, pcie_s=math.inf), "finite"),
])
def test_bad_timings_are_refused_by_name(timings, message):
    with pytest.raises(ValueError, match=message):
        StepTimings(**timings)


def test_bad_priors_and_parameters_are_refused():
    with pytest.raises(ValueError, match="prior bandwidths"):
        prior(0.0, 1e9)
    with pytest.raises(ValueError, match="max_step"):
        SplitParams(max_step=0.0)


@settings(max_examples=30, deadline=None)
@given(prior_pcie=bandwidths, cpu=bandwidths, pcie=bandwidths, every=st.integers(1, P.patience))
def test_a_path_used_now_and_then_keeps_its_measurements(prior_pcie, cpu, pcie, every):
    """PCIe observed once every `every` <= patience steps while the CPU runs every step: it never
    relaxes toward the prior, so its estimate is its measurements'."""
    state = SplitEstimate(pcie, cpu, pcie_share(pcie, cpu), prior_pcie, cpu)
    history = [_timings(pcie, cpu, (1 << 20) if i % every == 0 else 0, 1 << 20) for i in range(200)]
    final = run(state, history)
    assert final.pcie_bps == pytest.approx(pcie, rel=1e-9)
    assert final.pcie_starved < P.patience
