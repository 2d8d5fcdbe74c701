"""`--moe-policy auto`'s live choice (reference/policy_choice.py) against simulated machines.

A simulated machine gives each mode a true step time; a step's measured time is it times a noise
factor in [1 - n, 1 + n]. Checked (p = params, best = the fastest mode's true time):
 0. The modes are one plan: hybrid's rules at r = 1 plan exactly as transfer's, at r = 0 exactly
    as cpu's (reference/expert_cache.py), so a mode switch is only a new share.
 1. Every choice a probe makes is within (1 + n) / (1 - n) / (1 - margin) of best.
 2. With nothing changing and n <= drift / (2 + drift) (so noise alone cannot look like drift),
    probes come once per `period` steps, each of 3 * (settle + measure) steps (2 of them in the
    modes not chosen before it), and between probes the chosen mode runs.
 3. After the chosen mode slows by more than (1 + drift)(1 + n)/(1 - n), a probe starts within
    `window` steps and its choice obeys 1 for the new times.
 4. Steps that are not clean (ns None) or at another batch size do not break 1 while every
    mode still gets its clean steps within `patience`.
 5. A mode within the margin of the incumbent never replaces it (no flapping on ties).
 6. The back-off: at any noise, a watched probe starts at least window * 2**k steps (at most
    window * 2**doublings) after the choice before it and raises k by one (to at most
    doublings), also on a machine far noisier than drift; only a hold-off of calm watched steps
    lowers it; after watched probes a slower chosen mode is still probed, within the hold-off.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.reference.expert_cache import Q16, CacheState, plan_layer
from freetoken.reference.fetch_rule import FetchRule
from freetoken.reference.policy_choice import (
    CPU,
    HYBRID,
    MODES,
    TRANSFER,
    UNWATCHED,
    ChoiceParams,
    StepTiming,
    initial_choice,
    mode_ratio_q16,
    next_choice,
)

times = st.floats(1e6, 1e8)  # ns per step: 1 ms .. 100 ms
machines = st.fixed_dictionaries({m: times for m in MODES})
DEFAULTS = ChoiceParams()


def _bound(noise: float, margin: float) -> float:
    return (1 + noise) / (1 - noise) / (1 - margin) * (1 + 1e-12)


class Machine:
    """Step times per mode, noisy; `rows`, hit rate and target constant unless changed."""

    def __init__(self, true: dict[str, float], noise: float, seed: int, rows: int = 1) -> None:
        self.true, self.noise, self.rng, self.rows = dict(true), noise, random.Random(seed), rows

    def step(self, mode: str, clean: bool = True, rows: int | None = None) -> StepTiming:
        ns = max(1, round(self.true[mode] * self.rng.uniform(1 - self.noise, 1 + self.noise)))
        return StepTiming(ns if clean else None, rows or self.rows, 0.5, 0.8)


def run(machine: Machine, steps: int, state=None, params: ChoiceParams = DEFAULTS, clean=lambda i: True):
    """(final state, the mode of each step, the state after each step)."""
    state = state or initial_choice(params)
    modes, states = [], []
    for i in range(steps):
        modes.append(state.mode)
        state = next_choice(state, machine.step(state.mode, clean(i)))
        states.append(state)
    return state, modes, states


def choices(states) -> list[tuple[int, str]]:
    """(step, mode) of every choice a probe made (the probe's end)."""
    return [(s.step, s.mode) for prev, s in zip(states, states[1:], strict=False) if prev.probing and not s.probing]


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 3), experts=st.integers(2, 8), slots=st.integers(1, 12), k=st.integers(1, 3),
       rule=st.sampled_from([FetchRule.QSTAR, FetchRule.QSTAR_RECURRING, FetchRule.QSTAR_BACKGROUND]),
       seed=st.integers(0, 2**31 - 1))
def test_hybrids_plan_at_the_ends_is_transfers_and_cpus(layers, experts, slots, k, rule, seed):
    rng = random.Random(seed)
    k = min(k, experts)
    for end, same_as in ((Q16, FetchRule.ALL), (0, FetchRule.NONE)):
        a, b = CacheState(layers, experts, slots), CacheState(layers, experts, slots)
        for _ in range(30):
            layer = rng.randrange(layers)
            ids = [rng.sample(range(experts), k) for _ in range(rng.randint(1, 3))]
            assert plan_layer(a, layer, ids, rule, end) == plan_layer(b, layer, ids, same_as)
        assert (a.slot_of, a.last_used) == (b.slot_of, b.last_used)
    assert mode_ratio_q16(TRANSFER, 123) == Q16 and mode_ratio_q16(CPU, 123) == 0 and mode_ratio_q16(HYBRID, 123) == 123


@settings(max_examples=60, deadline=None)
@given(true=machines, noise=st.floats(0.0, 0.2), seed=st.integers(0, 2**31 - 1))
def test_every_choice_is_near_the_fastest_mode(true, noise, seed):
    probe = len(MODES) * (DEFAULTS.settle + DEFAULTS.measure)
    _, _, states = run(Machine(true, noise, seed), DEFAULTS.warmup + probe + 2 * (DEFAULTS.period + probe) + 10)
    made = choices(states)
    assert len(made) >= 3  # warm-up, then a probe every period at most
    best = min(true.values())
    for _, mode in made:
        assert true[mode] <= best * _bound(noise, DEFAULTS.margin), (mode, true)


@settings(max_examples=40, deadline=None)
@given(true=machines, noise=st.floats(0.0, DEFAULTS.drift / (2 + DEFAULTS.drift)), seed=st.integers(0, 2**31 - 1))
def test_probes_are_periodic_and_cost_what_they_state_when_nothing_changes(true, noise, seed):
    p = DEFAULTS
    steps = p.warmup + 3 * p.period + 100
    final, modes, states = run(Machine(true, noise, seed), steps)
    made = choices(states)
    for (a, _), (b, _) in zip(made, made[1:], strict=False):
        assert b - a == p.period + len(MODES) * (p.settle + p.measure)  # only the period started probes
    assert all(s.last_reason in ("warm-up", "warm-up over", "period") for s in states)
    # between probes the chosen mode runs; a probe runs the others for 2 * (settle + measure) steps
    probe_steps = sum(1 for s in [initial_choice(p), *states][:-1] if s.probing)
    assert probe_steps <= final.probes * len(MODES) * (p.settle + p.measure)
    assert final.probes <= 1 + (steps - p.warmup) // p.period
    assert modes[p.warmup + 3 * (p.settle + p.measure)] == made[0][1]  # the choice runs after the first probe


@settings(max_examples=60, deadline=None)
@given(before=machines, slower=st.floats(1.0, 20.0), noise=st.floats(0.0, 0.08), seed=st.integers(0, 2**31 - 1),
       after_choice=st.integers(DEFAULTS.window, 200))
def test_a_slower_chosen_mode_is_probed_again_within_the_window(before, slower, noise, seed, after_choice):
    p = DEFAULTS
    machine = Machine(before, noise, seed)
    state, _, states = run(machine, p.warmup + len(MODES) * (p.settle + p.measure) + after_choice)
    assert not state.probing and state.probes == 1
    chosen = state.mode
    factor = (1 + p.drift) * (1 + noise) / (1 - noise) * 1.001 * slower
    machine.true[chosen] *= factor
    state, _, states = run(machine, p.window + 1 + len(MODES) * (p.settle + p.measure), state)
    started = [i for i, s in enumerate(states) if s.probes == 2]
    assert started and started[0] < p.window, "no probe within the window after the chosen mode slowed"
    assert not state.probing
    assert machine.true[state.mode] <= min(machine.true.values()) * _bound(noise, p.margin)


@settings(max_examples=40, deadline=None)
@given(true=st.floats(1e6, 1e8), spread=st.lists(st.floats(1.0, 1.5), min_size=3, max_size=3),
       noise=st.floats(0.3, 0.6), seed=st.integers(0, 2**31 - 1))
def test_watched_probes_back_off_on_a_machine_noisier_than_the_drift(true, spread, noise, seed):
    p = DEFAULTS
    machine = Machine(dict(zip(MODES, (true * f for f in spread), strict=True)), noise, seed)
    steps = p.warmup + 2 * p.period
    _, _, states = run(machine, steps)
    before, chose_at, holdoff = initial_choice(p), None, None
    for s in states:
        started = s.probes > before.probes
        if started and s.last_reason not in UNWATCHED:
            assert s.step - chose_at >= holdoff, "a watched probe inside the hold-off"
            assert s.backoff == min(before.backoff + 1, p.doublings)
        elif before.probing or started:
            assert s.backoff == before.backoff
        else:  # the watch looked (or waited) and did not fire: k falls only after a calm hold-off
            assert s.backoff in (before.backoff, before.backoff - 1)
            if s.backoff < before.backoff:
                assert before.calm + 1 >= before.holdoff
        assert s.backoff <= p.doublings and s.holdoff == min(p.window << s.backoff, p.period)
        if before.probing and not s.probing:
            chose_at, holdoff = s.step, s.holdoff
        before = s


@settings(max_examples=40, deadline=None)
@given(before=machines, noise=st.floats(0.0, 0.08), backoff=st.integers(0, DEFAULTS.doublings),
       seed=st.integers(0, 2**31 - 1))
def test_after_watched_probes_a_slower_chosen_mode_is_probed_within_the_holdoff(before, noise, backoff, seed):
    p = DEFAULTS
    machine = Machine(before, noise, seed)
    state, _, _ = run(machine, p.warmup + len(MODES) * (p.settle + p.measure) + 1)
    assert not state.probing and state.probes == 1 and state.backoff == 0
    state = replace(state, backoff=backoff)  # as if the watch had fired that many times
    holdoff = state.holdoff
    machine.true[state.mode] *= (1 + p.drift) * (1 + noise) / (1 - noise) * 1.001
    state, _, states = run(machine, holdoff + len(MODES) * (p.settle + p.measure) + 1, state)
    started = [i for i, s in enumerate(states) if s.probes == 2]
    assert started and started[0] < holdoff, "no probe within the hold-off after the chosen mode slowed"
    assert not state.probing
    assert machine.true[state.mode] <= min(machine.true.values()) * _bound(noise, p.margin)


def test_a_calm_watch_undoes_the_backoff():
    p = DEFAULTS
    machine = Machine({m: 1e7 for m in MODES}, 0.0, 0)
    state, _, _ = run(machine, p.warmup + len(MODES) * (p.settle + p.measure) + 1)
    state = replace(state, backoff=3)
    # a hold-off of waiting, then one calm hold-off at each k: 3 to 0
    steps = sum(2 * (p.window << k) for k in (3, 2, 1)) + p.window
    state, _, _ = run(machine, steps, state)
    assert state.backoff == 0 and state.holdoff == p.window and state.probes == 1


@settings(max_examples=40, deadline=None)
@given(true=machines, noise=st.floats(0.0, 0.1), every=st.integers(2, 4), seed=st.integers(0, 2**31 - 1))
def test_unclean_steps_and_other_batch_sizes_are_not_measured(true, noise, every, seed):
    p = DEFAULTS
    machine = Machine(true, noise, seed)
    state = initial_choice(p)
    made = []
    for i in range(p.warmup + 400):
        was_probing = state.probing
        # every `every`-th step unclean, and the step after it at another batch size
        state = next_choice(state, machine.step(state.mode, clean=i % every != 0, rows=2 if i % every == 1 else 1))
        if was_probing and not state.probing:
            made.append(state.mode)
            assert {m for m, _ in state.measured} == set(MODES)  # patience enough: every mode measured
    assert made
    for mode in made:
        assert true[mode] <= min(true.values()) * _bound(noise, p.margin)


@settings(max_examples=40, deadline=None)
@given(base=times, others=st.lists(st.floats(1 - DEFAULTS.margin * 0.9, 2.0), min_size=2, max_size=2),
       seed=st.integers(0, 2**31 - 1))
def test_a_mode_within_the_margin_never_replaces_the_incumbent(base, others, seed):
    true = {HYBRID: base, TRANSFER: base * others[0], CPU: base * others[1]}
    final, modes, _ = run(Machine(true, 0.0, seed), DEFAULTS.warmup + 2 * DEFAULTS.period)
    assert final.switches == 0 and final.mode == HYBRID


def test_params_and_timings_are_checked():
    with pytest.raises(ValueError, match="period"):
        ChoiceParams(period=10)
    with pytest.raises(ValueError, match="margin"):
        ChoiceParams(margin=1.0)
    with pytest.raises(ValueError, match="measure"):
        ChoiceParams(measure=0)
    with pytest.raises(ValueError, match="> 0 ns"):
        StepTiming(0, 1, 0.5, None)
    with pytest.raises(ValueError, match="row"):
        StepTiming(10, 0, 0.5, None)
    with pytest.raises(ValueError, match="unknown mode"):
        mode_ratio_q16("resident", 0)
