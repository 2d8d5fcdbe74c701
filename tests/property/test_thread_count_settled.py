"""The thread-count search (reference/thread_count.py) settled from a reference, against simulated
workloads (tests/property/thread_landscapes.py; notation and properties 1-6 in test_thread_count.py).
 7. Settled from a reference (a profile's rate for every thread): a machine within the noise of it is never
    probed, whatever the landscape below (so a faster count elsewhere stays unfound: shown); a home that
    slows by more than 1 + change searches at once; a bad reference is refused, and one given below
    max_threads is not taken.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.reference.thread_count import ThreadParams, initial_threads
from tests.property.thread_landscapes import (
    felt_busy_start,
    idles,
    landscapes,
    pass_steps,
    seeds,
    setups,
    simulate,
    units,
    waits,
)


@settings(max_examples=60, deadline=None)
@given(setup=setups(), data=st.data(), seed=seeds, idle=idles, steps=st.integers(1, 1500))
def test_a_machine_that_serves_as_its_profile_measured_is_never_probed(setup, data, seed, idle, steps):
    params, n = setup
    c = params.max_threads
    truth = data.draw(landscapes(c))
    rng = random.Random(seed)
    reference = truth[c] * rng.uniform(1 - n, 1 + n)  # what the profile measured, within the noise
    states, used = simulate(initial_threads(c, params, reference), truth, steps, rng, n, idle)
    assert set(used) == {c} and all(s.settled and s.probes == 0 for s in states)
    assert states[-1].reference >= reference  # (it only rises)


def test_a_settled_home_leaves_a_faster_count_elsewhere_unfound():
    """What settling costs: a landscape whose count 1 is ten times faster than C, with C as fast as its
    reference, is never probed (a search would find it)."""
    params, truth = ThreadParams(4, window=1), {1: 10.0, 2: 1.0, 3: 1.0, 4: 1.0}
    states, used = simulate(initial_threads(4, params, reference=1.0), truth, 500, random.Random(0), 0.0)
    assert set(used) == {4} and states[-1].probes == 0
    searched, _ = simulate(initial_threads(4, params), truth, 500, random.Random(0), 0.0)
    assert searched[-1].home == 1


@settings(max_examples=40, deadline=None)
@given(setup=setups(2, 16), data=st.data(), unit=units, seed=seeds, idle=idles)
def test_a_settled_home_that_slows_searches_at_once(setup, data, unit, seed, idle):
    params, n = setup
    c, w = params.max_threads, params.window
    b, free, taken = felt_busy_start(params, n, data, unit)
    rng = random.Random(seed)
    bound = w * (2 + waits(b - 1, params.max_wait))  # its home window, B - 1 failed rungs, then C - B
    states, _ = simulate(initial_threads(c, params, free[c]), taken, bound + pass_steps(params), rng, n, idle)
    homes = [s.home for s in states]
    assert homes.index(c - b) < bound and max(homes[homes.index(c - b):]) <= c - b


@pytest.mark.parametrize("reference", [0.0, -1.0, math.inf, math.nan])
def test_a_bad_reference_is_refused(reference):
    with pytest.raises(ValueError, match="thread count: the reference rate must be positive and finite"):
        initial_threads(4, ThreadParams(8), reference)


def test_a_reference_below_every_thread_is_not_taken():
    """The reference is every thread's rate: a start below max_threads searches as without one."""
    assert not initial_threads(3, ThreadParams(8), 1e9).settled
    assert initial_threads(8, ThreadParams(8), 1e9).settled
