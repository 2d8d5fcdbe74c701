"""The thread-count search (reference/thread_count.py) against simulated workloads.

A workload is a landscape, the true CPU rate of each count T in 1..C (C = max_threads), measured with noise
n: busy (B of C cores taken by another process), flat, single-peaked or any (tests/property/thread_landscapes.py).
Why: the engine cannot see the other process, so the search must find C - B from measurements alone.

Notation: W = window, M = max_wait, L = C - 1 (the ladder's length), P(k) = k + sum_{f=1..k} min(f, M)
(the windows of k failed probes and the home windows after each), F = (1 + margin)(1 + n) / (1 - n).
Step counts below are steps with a rate (None steps change nothing but `step`). Properties 2-5 take
margin >= 2n / (1 - n) (a kept probe is really faster); 3-5 also change >= 2n / (1 - n) (two home
medians of one count never differ by more than 1 + change, so noise alone never restarts the ladder).
 1. threads and home stay in [1, C], threads is home or a rung of home's ladder; next_threads is pure and
    deterministic; bad rates and bad params raise ValueError naming the thread count. The ladder holds
    every other count, nearest first, the lead side first.
 2. On a landscape that holds, every move goes to a count of higher true rate, so at most m moves, m the
    counts faster than the start. The margin bound is tight: below it, a move to a slower count is shown.
    One outlier step per window (any rate) moves nothing: the lower median is the truth.
 3. From any start, the home is within F of the best from step W(1 + m(P(L - 1) + 1)) on (the first home
    window, then at most m climbs, each after at most L - 1 failed probes), and whenever a whole ladder
    pass failed (failed >= L). B of C busy (s such that C - B beats every count above by more than F),
    from T = C: the probes walk C - 1, C - 2, ... with their waits; home is C before step W(2 + P(B - 1)),
    C - B at it and never above after (55 steps with the defaults, C = 16, B = 4). Without
    change >= 2n / (1 - n) the far rungs may never be probed: shown.
 4. Flat: home never moves and probes run on a fixed schedule: probe i is window i + 1 + sum_{f<i} min(f, M),
    at rung (i - 1) mod L. Below C, p probes in N windows satisfy N - 2 < p(1 + M) <= N - 1 + M(M + 1)/2: the
    probing share tends to 1 / (1 + M). From C, the first L probes only: a failed pass settles the search.
 5. After a change (any state, the switch at any step) that a settled home feels (or with the search on), the
    home is within F of the new best from step
    W(3 + L(M + 1) + (L - 1)(P(L - 1) + 1)) on: the window in flight and at most two more until the home's
    median is measured on the new landscape, then at most L probes of M + 1 windows each until the
    first move (the ladder may be mid-pass, behind max_wait waits), then at most L - 1 climbs as in 3.
    Moves after step 3W go to a faster count (earlier ones weigh a probe against the old median).
    A busy process that starts under a home at C (its rate falling by more than 1 + change can hide)
    restarts the ladder: home is C - B within W(4 + P(B - 1)) steps, however long the back-off had grown, or
    settled. A change a settled home does not feel starts no search: its new rate is within the factor
    (1 + change)(1 + n) of its reference, which is all that is claimed of it (a faster count elsewhere
    stays unfound: shown in test_thread_count_settled.py, with property 7).
 6. threads_trace equals folding next_threads step by step.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.reference.thread_count import ThreadParams, initial_threads, ladder, next_threads, threads_trace
from tests.property.thread_landscapes import (
    busy,
    factor,
    felt_busy_start,
    idles,
    landscape_pairs,
    landscapes,
    least,
    near_best,
    pass_steps,
    seeds,
    settled_after,
    setups,
    simulate,
    units,
    waits,
)

# 1. bounds, purity, refusals ---------------------------------------------------------------------------

any_params = st.builds(ThreadParams, max_threads=st.integers(1, 12), window=st.integers(1, 6),
                       margin=st.floats(1e-3, 2.0), max_wait=st.integers(1, 8), change=st.floats(1e-3, 3.0))
any_rates = st.lists(st.none() | st.floats(1e-3, 1e15), max_size=150)


def assert_invariants(state) -> None:
    p = state.params
    assert 1 <= state.home <= p.max_threads and 1 <= state.threads <= p.max_threads
    assert state.threads == state.home or state.threads in ladder(state.home, state.lead, p.max_threads)
    assert len(state.rates) < p.window and 0 <= state.wait <= p.max_wait and state.lead in (-1, 1)
    assert state.failed >= 0 and 0 <= state.moves <= state.probes
    if state.settled:
        assert state.home == state.threads == p.max_threads and state.reference > 0


@settings(max_examples=80, deadline=None)
@given(params=any_params, start=st.integers(-3, 15), rates=any_rates)
def test_threads_stay_in_range_and_next_threads_is_pure(params, start, rates):
    state = initial_threads(start, params)
    assert state.threads == state.home == max(1, min(start, params.max_threads))
    for rate in rates:
        kept = copy.deepcopy(state)
        after = next_threads(state, rate)
        assert state == kept and next_threads(state, rate) == after
        assert after.step == state.step + 1
        if rate is None:  # says nothing
            assert after == dataclasses.replace(state, step=state.step + 1)
        assert_invariants(after)
        state = after
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.threads = 1


@settings(max_examples=40, deadline=None)
@given(home=st.integers(1, 20), lead=st.sampled_from([-1, 1]), c=st.integers(1, 20))
def test_the_ladder_holds_every_other_count_nearest_first_the_lead_side_first(home, lead, c):
    home = min(home, c)
    rungs = ladder(home, lead, c)
    assert sorted(rungs) == [t for t in range(1, c + 1) if t != home]
    distances = [abs(t - home) for t in rungs]
    assert distances == sorted(distances)
    for a, b in zip(rungs, rungs[1:], strict=False):
        if abs(a - home) == abs(b - home):
            assert (a - home) * lead > 0 > (b - home) * lead


@pytest.mark.parametrize("rate", [0.0, -1.0, math.inf, -math.inf, math.nan])
def test_bad_rates_are_refused(rate):
    with pytest.raises(ValueError, match="thread count: a step's CPU rate must be positive and finite"):
        next_threads(initial_threads(4, ThreadParams(8)), rate)


@pytest.mark.parametrize("bad", [dict(max_threads=0), dict(max_threads=2.5), dict(max_threads=True), dict(window=0),
                                 dict(max_wait=0), dict(window=-1), dict(margin=0.0), dict(margin=-0.1),
                                 dict(margin=math.inf), dict(margin=math.nan), dict(change=0.0),
                                 dict(change=math.inf), dict(change=math.nan)])
def test_bad_params_are_refused(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=f"thread count: {name} must be"):
        ThreadParams(**{"max_threads": 8, **bad})


# 2. a move goes to a faster count -------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(c=st.integers(1, 12), n=st.floats(0.0, 0.3), slack=st.floats(0.0, 0.5), change=st.floats(1e-3, 1.0),
       window=st.integers(1, 6), max_wait=st.integers(1, 8), data=st.data(), seed=seeds, idle=idles,
       steps=st.integers(1, 1500))
def test_a_move_goes_to_a_faster_count(c, n, slack, change, window, max_wait, data, seed, idle, steps):
    params = ThreadParams(c, window=window, margin=max(least(n) + slack, 1e-3), max_wait=max_wait, change=change)
    truth = data.draw(landscapes(c))
    start = data.draw(st.integers(1, c))
    states, _ = simulate(initial_threads(start, params), truth, steps, random.Random(seed), n, idle)
    homes = [start] + [s.home for s in states]
    for before, after in zip(homes, homes[1:], strict=False):
        assert before == after or truth[after] > truth[before], (before, after)
    assert states[-1].moves <= sum(rate > truth[start] for rate in truth.values())


def test_below_the_least_margin_a_move_can_go_to_a_slower_count():
    n, truth = 0.1, {1: 0.99e9, 2: 1e9}  # 2n / (1 - n) = 0.22 > margin
    for margin, moves in ((0.05, True), (0.23, False)):
        state = initial_threads(2, ThreadParams(2, window=1, margin=margin))
        state = next_threads(state, truth[2] * (1 - n))  # home, measured low; the probe of 1 starts
        assert state.threads == 1
        state = next_threads(state, truth[1] * (1 + n))  # the probe, measured high
        assert (state.home == 1) == moves


@settings(max_examples=40, deadline=None)
@given(c=st.integers(2, 12), window=st.integers(3, 6), unit=units, outliers=st.lists(st.floats(1e3, 1e15), max_size=60),
       seed=seeds)
def test_one_outlier_step_per_window_moves_nothing(c, window, unit, outliers, seed):
    """A descheduled (or lucky) step moves the lower median one rank: with exact steps around it, the medians
    are the truth and a flat landscape's home never moves."""
    params, rng = ThreadParams(c, window=window), random.Random(seed)
    state = initial_threads(c, params)
    for outlier in outliers:
        at = rng.randrange(window)
        for k in range(window):
            state = next_threads(state, outlier if k == at else unit)
        assert state.home == c and state.home_rate == unit and state.moves == 0


# 3. convergence ----------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(setup=setups(), data=st.data(), seed=seeds, idle=idles)
def test_the_home_gets_within_f_of_the_best_within_the_bound(setup, data, seed, idle):
    params, n = setup
    c, w, f = params.max_threads, params.window, factor(params, n)
    truth = data.draw(landscapes(c))
    start = data.draw(st.integers(1, c))
    m = sum(rate > truth[start] for rate in truth.values())
    bound = w * (1 + m * (waits(c - 2, params.max_wait) + 1)) if m else 0
    states, _ = simulate(initial_threads(start, params), truth, bound + pass_steps(params), random.Random(seed), n,
                         idle)
    assert settled_after(states, truth, f) <= bound
    for state in states:  # once a whole pass failed, the home is within f
        if c > 1 and state.failed >= c - 1:
            assert near_best(state.home, truth, f)
    assert states[-1].moves <= m


@settings(max_examples=40, deadline=None)
@given(setup=setups(2, 16), data=st.data(), unit=units, seed=seeds, idle=idles)
def test_with_b_of_c_cores_busy_the_home_leaves_the_top_for_c_minus_b(setup, data, unit, seed, idle):
    params, n = setup
    c, w = params.max_threads, params.window
    b, cap = data.draw(st.integers(1, c - 1)), data.draw(st.integers(1, c))
    # the busy cores' speed: C - B beats every count above it by more than F
    s = data.draw(st.floats(0.05, 0.95)) * min(c - b, cap) / (factor(params, n) * c)
    truth = busy(c, b, cap, s, unit)
    at = w * (2 + waits(b - 1, params.max_wait))  # the home window, B - 1 rungs that straggle, then C - B
    states, used = simulate(initial_threads(c, params), truth, at + pass_steps(params), random.Random(seed), n, idle)
    homes = [state.home for state in states]
    assert homes[:at - 1] == [c] * (at - 1) and homes[at - 1] == c - b
    assert max(homes[at - 1:]) <= c - b
    # the probes walk down the rungs C - 1, C - 2, ..., each failed one followed by min(k, M) home windows
    walk = [c] * w + [t for k in range(1, b) for t in [c - k] * w + [c] * w * min(k, params.max_wait)]
    assert used[:at] == walk + [c - b] * w


def test_the_defaults_reach_c_minus_b_in_55_steps():
    params = ThreadParams(16)
    truth = busy(16, 4, 16, 0.5, 1e9)  # 12 free cores: 12 threads' worth; 13..16 straggle at 6.5..8
    states, _ = simulate(initial_threads(16, params), truth, 60, random.Random(0), 0.0)
    assert [s.home for s in states].index(12) + 1 == 5 * (2 + waits(3, 8)) == 55


def test_noise_above_change_can_keep_the_far_rungs_unprobed():
    """n = 0.2 with change = 0.25 < 2n / (1 - n) = 0.5: home medians alternating 0.8 and 1.2 of the truth
    look like changes and restart the ladder at its first rung, so count 1, ten times faster, is never tried."""
    params = ThreadParams(4, window=1, margin=0.6, max_wait=1, change=0.25)
    truth = {1: 10.0, 2: 1.0, 3: 1.0, 4: 1.0}
    state, probed = initial_threads(4, params), set()
    for i in range(200):
        if state.probing:
            probed.add(state.threads)
            noise = 0.8
        else:
            noise = 0.8 if i % 4 == 0 else 1.2
        state = next_threads(state, truth[state.threads] * noise)
    assert probed == {3} and state.home == 4 and not near_best(4, truth, (1 + 0.6) * 1.2 / 0.8)


# 4. a flat landscape ----------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(setup=setups(), start=st.integers(1, 12), unit=units, seed=seeds, idle=idles, cycles=st.integers(10, 40))
def test_a_flat_landscape_is_probed_ever_less_or_not_at_all_and_home_stays(setup, start, unit, seed, idle, cycles):
    params, n = setup
    c, w, m = params.max_threads, params.window, params.max_wait
    start = min(start, c)
    windows = cycles * (1 + m)
    states, used = simulate(initial_threads(start, params), {t: unit for t in range(1, c + 1)}, windows * w,
                            random.Random(seed), n, idle)
    assert all(state.home == start and state.moves == 0 for state in states)
    counts = [used[j * w:(j + 1) * w] for j in range(windows)]
    assert all(len(set(window)) == 1 for window in counts)
    probed = [j + 1 for j, window in enumerate(counts) if window[0] != start]  # window numbers, from 1
    rungs = ladder(start, -1, c)
    schedule = [i + 1 + sum(min(f, m) for f in range(1, i)) for i in range(1, windows + 1)] if rungs else []
    if start == c and rungs:  # one pass, then settled: no probe more
        schedule = schedule[: len(rungs)]
        assert states[-1].settled == (schedule[-1:] <= [windows - 1])  # (settled once its last probe is weighed)
    assert probed == [j for j in schedule if j <= windows]
    assert [counts[j - 1][0] for j in probed] == [rungs[i % len(rungs)] for i in range(len(probed))]
    p = len(probed)
    if rungs and start < c:
        assert windows - 2 < p * (1 + m) <= windows - 1 + m * (m + 1) / 2
    assert sum(t != start for t in used) == w * p


# 5. a change of landscape ----------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(setup=setups(), data=st.data(), seed=seeds, idle=idles, before=st.integers(0, 1500))
def test_a_change_of_landscape_is_followed_within_the_bound(setup, data, seed, idle, before):
    params, n = setup
    c, w, mw, f = params.max_threads, params.window, params.max_wait, factor(params, n)
    old, new = data.draw(landscape_pairs(c))
    rng = random.Random(seed)
    state = initial_threads(data.draw(st.integers(1, c)), params)
    if before:  # the change comes anywhere: mid-window, mid-probe, settled or not
        state = simulate(state, old, before, rng, n, idle)[0][-1]
    ell = c - 1
    bound = w * (3 + ell * (mw + 1) + max(ell - 1, 0) * (waits(ell - 1, mw) + 1)) if ell else 0
    states, _ = simulate(state, new, bound + pass_steps(params), rng, n, idle)
    if state.settled and all(s.settled for s in states):
        # A change the settled home never felt (its medians stayed within 1 + change of its
        # reference): no search, and the home's new rate is within that factor, and the noise's, of it.
        assert new[c] * (1 + n) * (1 + params.change) * (1 + 1e-9) >= min(s.reference for s in states)
        return
    assert settled_after(states, new, f) <= bound
    homes = [state.home] + [s.home for s in states]
    for k, (a, b) in enumerate(zip(homes, homes[1:], strict=False)):
        if k + 1 > 3 * w and a != b:
            assert new[b] > new[a], (k, a, b)


@settings(max_examples=40, deadline=None)
@given(setup=setups(2, 16), data=st.data(), unit=units, seed=seeds, idle=idles,
       before=st.integers(0, 1500))
def test_a_busy_process_that_starts_restarts_the_ladder(setup, data, unit, seed, idle, before):
    params, n = setup
    c, w = params.max_threads, params.window
    b, free, taken = felt_busy_start(params, n, data, unit)
    rng = random.Random(seed)
    state = initial_threads(c, params)
    if before:  # at home C on the free cores (searching or settled), the back-off anywhere up to max_wait
        state = simulate(state, free, before, rng, n, idle)[0][-1]
        assert state.home == c
    bound = w * (3 + 1 + waits(b - 1, params.max_wait))  # the restart, then B - 1 failed rungs and C - B
    states, _ = simulate(state, taken, bound + pass_steps(params), rng, n, idle)
    homes = [s.home for s in states]
    first = homes.index(c - b)
    assert first < bound and set(homes[:first]) <= {c} and max(homes[first:]) <= c - b


# 6. the trace ------------------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(params=any_params, start=st.integers(-3, 15), rates=any_rates)
def test_threads_trace_folds_next_threads(params, start, rates):
    state, folded = initial_threads(start, params), []
    for rate in rates:
        state = next_threads(state, rate)
        folded.append(state.threads)
    assert threads_trace(start, rates, params) == folded
