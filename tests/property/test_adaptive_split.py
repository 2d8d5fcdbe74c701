"""The adaptive split (reference/adaptive_split.py) against simulated links.

A simulated link has a true rate in bytes/s; a sample is (bytes, ns) with ns the bytes' time at
that rate (times a noise factor in [1 - n, 1 + n] where stated). Properties 1-3 sample both
links every step; property 4 samples them as the planner would use them: of M misses, q*(M, r)
are fetched (a PCIe sample if any) and the rest run on the CPU (a CPU sample if any), so a
ratio near 0 or 1 starves a link. Bounds checked (p = params, r* = the true share):
 1. |r_t - r_(t-1)| <= max_step always; with ±n noise and one outlier step (any rate in
    1e3..1e13 B/s), r is inside the noise band [share(P(1-n), C(1+n)), share(P(1+n), C(1-n))]
    from min_samples + ceil(1 / max_step) steps on, outlier included (for n = 0.2: within 0.1
    of r*); without noise the outlier does not move r at all.
 2. From any prior, exact samples: |r - r*| <= 0.02 from step min_samples + ceil(|r0 - r*| /
    max_step) on (<= window + ceil(...), the bound asked for).
 3. After a change of the true rates: from floor(window / 2) + 1 + ceil(|change of r*| /
    max_step) steps on (15 with the defaults for a change of 0.5, under the 20 asked for).
 4. A link starved by r near 0 or 1 that becomes faster is found again: within stale_steps +
    the probe's growth steps + min_samples + ceil(1 / max_step) + 3 steps, r is within 0.02 of
    the new r* and stays.
 5. next_state is pure and deterministic.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.reference.adaptive_split import (
    LinkState,
    SplitParams,
    StepSamples,
    initial_state,
    next_state,
    ratio_trace,
    step_rate,
)
from freetoken.reference.expert_cache import pcie_share, qstar, share_q16

EXPERT = 1 << 24  # bytes per expert in the simulated links
CLOSE = 0.02

rates = st.floats(8.0, 11.0).map(lambda e: 10.0**e)  # 100 MB/s .. 100 GB/s
shares = st.floats(0.01, 0.99)
any_params = st.builds(SplitParams, window=st.integers(3, 12), min_samples=st.integers(3, 3),
                       max_step=st.floats(0.02, 0.25)).flatmap(
    lambda p: st.integers(3, p.window).map(lambda m: dataclasses.replace(p, min_samples=m)))
params_or_defaults = st.one_of(st.just(SplitParams()), any_params)


def timed(rate: float, nbytes: int = EXPERT) -> tuple[int, int]:
    return nbytes, max(1, round(nbytes * 1e9 / rate))


def noisy(rng: random.Random, rate: float, noise: float) -> tuple[tuple[int, int], ...]:
    """One to three samples (a few layers' work) at rate times a factor in [1 - noise, 1 + noise]."""
    return tuple(timed(rate * rng.uniform(1 - noise, 1 + noise), rng.randint(1, 8) * EXPERT)
                 for _ in range(rng.randint(1, 3)))


def both(p: float, c: float) -> StepSamples:
    return StepSamples((timed(p),), (timed(c),))


def prior_for(r0: float, scale: float) -> tuple[float, float]:
    return r0 * scale, (1 - r0) * scale


def first_close_from(trace: list[float], target: float) -> int:
    """The first step (1-based) from which every r of the trace is within CLOSE of target."""
    n = len(trace)
    while n > 0 and abs(trace[n - 1] - target) <= CLOSE:
        n -= 1
    return n + 1


def assert_steps_bounded(start: float, trace: list[float], max_step: float) -> None:
    for before, after in zip([start, *trace], trace, strict=False):
        assert abs(after - before) <= max_step + 1e-12, (before, after)


# 1. stability ---------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(params=params_or_defaults, p=rates, c=rates, r0=shares, scale=rates, seed=st.integers(0, 2**32),
       noise=st.sampled_from([0.0, 0.05, 0.2]), at=st.integers(0, 200), on_pcie=st.booleans(),
       outlier=st.floats(3.0, 13.0).map(lambda e: 10.0**e))
def test_an_outlier_step_stays_inside_the_noise_band(params, p, c, r0, scale, seed, noise, at, on_pcie, outlier):
    settle = params.min_samples + math.ceil(1 / params.max_step)
    n = settle + 40
    at %= n
    rng = random.Random(seed)
    clean = [StepSamples(noisy(rng, p, noise), noisy(rng, c, noise)) for _ in range(n)]
    hit = clean[at]
    bad = (timed(outlier),)
    dirty = list(clean)
    dirty[at] = StepSamples(bad, hit.cpu_expert) if on_pcie else StepSamples(hit.pcie_fill, bad)
    prior = prior_for(r0, scale)
    with_outlier, without = ratio_trace(prior, dirty, params), ratio_trace(prior, clean, params)
    start = initial_state(*prior, params).ratio
    assert_steps_bounded(start, with_outlier, params.max_step)
    lo = pcie_share(p * (1 - noise), c * (1 + noise)) - 1e-6
    hi = pcie_share(p * (1 + noise), c * (1 - noise)) + 1e-6
    for t in range(settle - 1, n):
        assert lo <= with_outlier[t] <= hi, (t, lo, with_outlier[t], hi)
        assert abs(with_outlier[t] - without[t]) <= hi - lo
    if noise == 0.0:  # equal but for the ns rounding of the samples
        assert max(abs(a - b) for a, b in zip(with_outlier, without, strict=True)) <= 1e-5


# 2. convergence from any prior ------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(params=params_or_defaults, p=rates, c=rates, r0=st.floats(0.001, 0.999), scale=rates)
def test_converges_from_any_prior(params, p, c, r0, scale):
    prior = prior_for(r0, scale)
    start = initial_state(*prior, params).ratio
    truth = pcie_share(p, c)
    bound = params.min_samples + math.ceil(abs(start - truth) / params.max_step)
    trace = ratio_trace(prior, [both(p, c)] * (bound + 30), params)
    assert_steps_bounded(start, trace, params.max_step)
    assert first_close_from(trace, truth) <= bound <= params.window + math.ceil(abs(start - truth) / params.max_step)


# 3. after the machine changes -------------------------------------------------------------------

def settled_then_changed(params: SplitParams, before: tuple[float, float], after: tuple[float, float],
                         extra: int) -> list[float]:
    """r after each step of the new rates, from a state settled on the old ones."""
    state = initial_state(*before, params)
    for _ in range(params.window + math.ceil(1 / params.max_step) + 1):
        state = next_state(state, both(*before))
    assert abs(state.ratio - pcie_share(*before)) < 1e-4  # settled
    out = []
    for _ in range(extra):
        state = next_state(state, both(*after))
        out.append(state.ratio)
    return out


def change_bound(params: SplitParams, change: float) -> int:
    return params.window // 2 + 1 + math.ceil(change / params.max_step)


@settings(max_examples=60, deadline=None)
@given(params=params_or_defaults, r_old=shares, r_new=shares, s_old=rates, s_new=rates)
def test_settles_after_the_rates_change(params, r_old, r_new, s_old, s_new):
    change = abs(r_new - r_old)
    bound = change_bound(params, change)
    trace = settled_then_changed(params, prior_for(r_old, s_old), prior_for(r_new, s_new), bound + 30)
    assert first_close_from(trace, r_new) <= bound


@settings(max_examples=30, deadline=None)
@given(r_old=shares, change=st.floats(-0.5, 0.5), s_old=rates, s_new=rates)
def test_defaults_settle_a_change_of_half_within_twenty_steps(r_old, change, s_old, s_new):
    r_new = min(0.99, max(0.01, r_old + change))
    trace = settled_then_changed(SplitParams(), prior_for(r_old, s_old), prior_for(r_new, s_new), 50)
    assert first_close_from(trace, r_new) <= change_bound(SplitParams(), 0.5) == 15 <= 20


# 4. starvation ------------------------------------------------------------------------------

def planned_step(r: float, misses: int, p: float, c: float) -> StepSamples:
    """The samples of a layer with `misses` misses planned at share r, as q* splits them."""
    fetched = qstar(misses, share_q16(r))
    pcie = (timed(p, fetched * EXPERT),) if fetched else ()
    cpu = (timed(c, (misses - fetched) * EXPERT),) if misses - fetched else ()
    return StepSamples(pcie, cpu)


@settings(max_examples=60, deadline=None)
@given(misses=st.integers(8, 32), starve_pcie=st.booleans(), r1=st.floats(0.001, 0.02), r2=st.floats(0.15, 0.85),
       scale=rates, r0=shares, prior_scale=rates, phase1=st.integers(0, 120))
def test_a_starved_link_that_gets_faster_is_found_again(misses, starve_pcie, r1, r2, scale, r0, prior_scale,
                                                         phase1):
    params = SplitParams()
    if starve_pcie:  # PCIe slow (another process copies), then free; the CPU unchanged
        p1, c = r1 * scale, (1 - r1) * scale
        p2 = c * r2 / (1 - r2)
        phases = [(p1, c), (p2, c)]
    else:  # the CPU slow (cores taken), then free; PCIe unchanged
        p, c1 = (1 - r1) * scale, r1 * scale
        phases = [(p, c1), (p, p * (1 - r2) / r2)]
    state = initial_state(*prior_for(r0, prior_scale), params)
    for _ in range(400):  # until the slow link is starved (a prior that starves the other link is probed away)
        state = next_state(state, planned_step(state.ratio, misses, *phases[0]))
        fetched = qstar(misses, state.ratio_q16)
        if fetched == (0 if starve_pcie else misses):
            break
    else:
        raise AssertionError("the slow link never went unused")
    for _ in range(phase1):  # the change comes anywhere in the probe's cycle
        state = next_state(state, planned_step(state.ratio, misses, *phases[0]))
    # How far the probe must raise the starved link's estimate before the planner uses it.
    prior = prior_for(r0, prior_scale)
    if starve_pcie:
        low, other = min(state.pcie.estimate, phases[0][0], prior[0]), max(state.cpu.estimate, phases[0][1])
    else:
        low, other = min(state.cpu.estimate, phases[0][1], prior[1]), max(state.pcie.estimate, phases[0][0])
    growth = math.ceil(max(0.0, math.log(other / (misses * low))) / math.log(params.probe_growth)) + 1
    bound = params.stale_steps + growth + params.min_samples + math.ceil(1 / params.max_step) + 3
    truth = pcie_share(*phases[1])
    trace = []
    for _ in range(bound + 40):
        before = state.ratio
        state = next_state(state, planned_step(state.ratio, misses, *phases[1]))
        assert abs(state.ratio - before) <= params.max_step + 1e-12
        trace.append(state.ratio)
    assert first_close_from(trace, truth) <= bound


# 5. purity, and bounds under any input ---------------------------------------------------------------

pairs = st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 10**10)), max_size=3)
step_lists = st.lists(st.tuples(pairs, pairs), max_size=80)


@settings(max_examples=60, deadline=None)
@given(params=any_params, p=rates, c=rates, raw=step_lists)
def test_next_state_is_pure_and_bounded_on_any_samples(params, p, c, raw):
    state = initial_state(p, c, params)
    trace = []
    for pcie_list, cpu_list in raw:
        given_list = list(pcie_list)
        samples = StepSamples(given_list, cpu_list)
        kept = copy.deepcopy(state)
        after = next_state(state, samples)
        assert after == next_state(state, samples)
        assert state == kept
        given_list.append((1, 1))  # the caller's list is not referenced by the samples or the state
        assert next_state(state, samples) == after
        assert 0.0 <= after.ratio <= 1.0 and 0 <= after.ratio_q16 <= 1 << 16
        assert abs(after.ratio - state.ratio) <= params.max_step + 1e-12
        assert after.pcie.estimate > 0 and after.cpu.estimate > 0 and math.isfinite(after.target)
        state = after
        trace.append(state.ratio)
    assert ratio_trace((p, c), [StepSamples(a, b) for a, b in raw], params) == trace
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.ratio = 0.5


# edge cases -------------------------------------------------------------------------------

def test_samples_of_zero_bytes_or_zero_time_say_nothing():
    state = initial_state(1e10, 2e10)
    nothing = next_state(state, StepSamples())
    assert next_state(state, StepSamples([(0, 500), (4096, 0)], [(0, 0)])) == nothing
    assert nothing.pcie.idle == nothing.cpu.idle == 1 and nothing.ratio == state.ratio
    assert step_rate([(0, 500), (1000, 1000), (3000, 1000), (5, 0)]) == 2e9
    assert step_rate([(0, 9)]) is None


@pytest.mark.parametrize("pair", [(-1, 10), (10, -1), (float("nan"), 10), (10, float("inf"))])
def test_bad_samples_are_refused(pair):
    with pytest.raises(ValueError, match="pcie_fill"):
        StepSamples([pair])
    with pytest.raises(ValueError, match="cpu_expert"):
        StepSamples((), [pair])


@pytest.mark.parametrize("bad", [dict(window=0), dict(window=2.5), dict(min_samples=0), dict(window=4, min_samples=5),
                                 dict(max_step=0.0), dict(max_step=1.5), dict(stale_steps=0), dict(probe_growth=1.0),
                                 dict(probe_growth=math.inf), dict(probe_cap=0.5), dict(window=True)])
def test_params_are_validated(bad):
    with pytest.raises(ValueError, match="adaptive split"):
        SplitParams(**bad)


@pytest.mark.parametrize("prior", [(0.0, 1e9), (1e9, -1.0), (math.inf, 1e9), (1e9, math.nan)])
def test_the_prior_must_be_positive_and_finite(prior):
    with pytest.raises(ValueError, match="profile"):
        initial_state(*prior)


def test_the_prior_stands_in_until_min_samples_then_the_median_rules():
    params = SplitParams(window=5, min_samples=3)
    state = initial_state(1e9, 1e9, params)
    for rate in (4e9, 8e9):
        state = next_state(state, StepSamples([timed(rate)], [timed(1e9)]))
        assert state.pcie.estimate == 1e9
    state = next_state(state, StepSamples([timed(6e9)], [timed(1e9)]))
    assert state.pcie.estimate == pytest.approx(6e9)
    state = next_state(state, StepSamples([timed(1e13)], [timed(1e9)]))  # outlier: the lower median moves one rank
    assert state.pcie.estimate == pytest.approx(6e9)


def test_an_unused_link_is_held_then_probed_never_decayed():
    params = SplitParams(stale_steps=4)
    state = initial_state(1e9, 9e9, params)
    for _ in range(3):
        state = next_state(state, StepSamples([timed(1e9)], [timed(9e9)]))
    cpu_only = StepSamples((), [timed(9e9)])
    for _ in range(params.stale_steps - 1):
        state = next_state(state, cpu_only)
        assert state.pcie == LinkState(pytest.approx(1e9), state.pcie.rates, state.pcie.idle) and state.pcie.rates
    estimates = []
    for _ in range(40):
        state = next_state(state, cpu_only)
        estimates.append(state.pcie.estimate)
        assert state.pcie.rates == ()  # the stale window is dropped
    assert estimates == sorted(estimates) and estimates[0] > 1e9
    assert estimates[-1] == pytest.approx(params.probe_cap * 9e9)  # capped, and r then at most that share
    idle_both = state
    for _ in range(100):  # nothing routed to either link: everything held
        state = next_state(state, StepSamples())
    assert (state.pcie.estimate, state.cpu.estimate, state.ratio) == (
        idle_both.pcie.estimate, idle_both.cpu.estimate, idle_both.ratio)
