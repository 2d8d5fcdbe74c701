"""The CPU expert executor's thread count, following the cores actually free: the specification.

Why: the executor runs each CPU expert call as one parallel loop over a Numba team of T threads,
and a parallel loop ends when its slowest thread does. When another process keeps some cores
busy, the team's threads that land on those cores run at a fraction of their speed and the whole
team waits for them: T = every core can answer far slower than T = the free cores (issue 34:
fewer threads that finish beat more that straggle). Which T is best depends on a load the engine
cannot see, so it is found by measuring: hybrid's live split (moe/live_split.py) already times
every CPU call, and at each decode step's end hands the step's CPU rate (bytes/s of its
`cpu_expert` samples, reference/adaptive_split.py's `step_rate`; None when the step ran nothing
on the CPU) to `next_threads`; the state's `threads` is the count the executor's next calls use.
Pure: no clock, no threads, no mutation, so the engine's wiring replays against it step by step.

The search: a hill-climb that probes. The state holds a home count and measures it for a window
of `window` steps with a rate (their lower median: one descheduled step moves it by one rank at
most, whatever its size), then runs one window at a probe count. A probe whose median beats the
home's by more than `margin` becomes the new home, and the next probe goes on the same way at
once (a climb costs one window a count). A probe that does not is dropped, and the home is held
for min(failed probes in a row, max_wait) windows before the next: the back-off, so that on a flat
landscape (memory bandwidth the limit, not cores) the share of steps spent probing falls to
1 / (1 + max_wait) and the count never moves.

Probes walk a ladder: the counts at distance 1 from home, then 2, 3, ... up to every count in
[1, max_threads], the side of the last move first, and wrap around. Unit steps alone are not
enough: with B of C cores busy, every T above C - B straggles, so from T = C one thread fewer is
no faster (still a straggler) and a climb by ones never leaves the top; the ladder reaches C - B.
The far rungs come only after the near ones failed, behind the longest waits.

The landscape changes (a busy process starts or stops): when a home window's median differs from
the previous one by more than the factor 1 + `change`, the back-off restarts from the first rung
with no wait. A change the home count does not feel (its threads were on free cores either way)
is found by the ladder's next pass, at most max_threads - 1 probes behind max_wait windows each.

Settling: probes cost (a probe of few threads runs its window at a fraction of the speed), and on
a quiet machine every one of them fails. So once a whole pass of the ladder has failed with every
thread at home (home = max_threads), the search settles: no probe at all while the home's medians
stay within the factor 1 + `change` of `reference`, the best median home has had since (it only
rises). A median below it (another process took cores, or their bandwidth) restarts the search from
the first rung, its bound on steps as after any change. Settled only at max_threads: below it the
probes go on, behind the back-off, since a count on free cores does not feel the cores coming back.
A search starts at once, unless the state starts from a `reference` (the rate a bandwidth profile
measured for every thread: hybrid's `bench bw`): then it starts settled, and a machine that serves
as fast as it measured never probes. What settling costs: a load that slows the home by less than
1 + change (with noise n, less than (1 + change)(1 + n) / (1 - n)) goes unsearched, so a settled
home's true rate is within that factor of the reference's, and on landscapes that a load only slows
(no count faster than before), of every count's.

Guarantees (tests/property/test_thread_count.py and test_thread_count_settled.py, with per-step
rates within a factor 1 +- n of the truth): threads stays in [1, max_threads]; while the truth
holds, a move goes to a count whose true rate is higher when margin >= 2n / (1 - n) (just after a
change, a probe weighed against the home's old median may move anywhere); once a whole pass of the
ladder has failed (failed >= max_threads - 1), the home's true rate is within the factor
(1 + margin)(1 + n) / (1 - n) of the best count's. Reaching that pass takes change >= 2n / (1 - n) as
well: noisier steps let two medians of the home differ by more than 1 + change, each such false
change restarts the ladder at its first rung, and the far rungs (C - B above) may never be probed
while no probe succeeds. With both, the bounds on steps, from the start and after a change, and the
probing share on a flat landscape are stated and checked there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ThreadParams:
    max_threads: int  # the ceiling: the thread pool Numba was started with
    window: int = 5  # steps with a CPU rate per measurement (their lower median)
    margin: float = 0.05  # a probe must beat the home's median by this fraction to be kept
    max_wait: int = 8  # the most home windows between two probes (the back-off's cap)
    change: float = 0.25  # a home median moving by more than this factor (1 + change) restarts the search

    def __post_init__(self) -> None:
        for name in ("max_threads", "window", "max_wait"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"thread count: {name} must be an int >= 1, got {value!r}")
        for name in ("margin", "change"):
            value = getattr(self, name)
            if not 0.0 < value < math.inf:
                raise ValueError(f"thread count: {name} must be positive and finite, got {value!r}")


@dataclass(frozen=True)
class ThreadState:
    params: ThreadParams
    threads: int  # the count the executor's next calls use: `home`, or the count being probed
    home: int  # the count held
    home_rate: float | None = None  # bytes/s: the median of home's last window (None before one)
    rates: tuple[float, ...] = ()  # this window's rates so far, at `threads`
    failed: int = 0  # probes failed in a row since the last move or change: the ladder's rung
    wait: int = 1  # home windows still to measure before the next probe
    lead: int = -1  # the side tried first at each distance: the last move's (fewer threads at first)
    reference: float | None = None  # bytes/s: settled (no probes) at max_threads; None: searching
    step: int = 0  # steps folded in
    probes: int = 0  # probe windows started
    moves: int = 0  # probes kept

    @property
    def probing(self) -> bool:
        return self.threads != self.home

    @property
    def settled(self) -> bool:
        return self.reference is not None


def ladder(home: int, lead: int, max_threads: int) -> list[int]:
    """Every other count in [1, max_threads], nearest to `home` first, the `lead` side first."""
    out = []
    for d in range(1, max_threads):
        out += [t for t in (home + lead * d, home - lead * d) if 1 <= t <= max_threads]
    return out


def initial_threads(threads: int, params: ThreadParams, reference: float | None = None) -> ThreadState:
    """The state before any step: `threads` (the executor's start count, clamped to
    [1, max_threads]) is home; its first window is measured before any probe. `reference`
    (bytes/s, what every thread measured on this machine): start settled if home is max_threads."""
    if reference is not None and not 0.0 < reference < math.inf:
        raise ValueError(f"thread count: the reference rate must be positive and finite, got {reference!r}")
    start = max(1, min(int(threads), params.max_threads))
    return ThreadState(params, start, start, reference=reference if start == params.max_threads else None)


def _probe(state: ThreadState) -> ThreadState:
    """Start the probe of the ladder's current rung (hold home when there is no other count)."""
    rungs = ladder(state.home, state.lead, state.params.max_threads)
    if not rungs:
        return replace(state, threads=state.home, wait=0)
    return replace(state, threads=rungs[state.failed % len(rungs)], wait=0, probes=state.probes + 1)


def next_threads(state: ThreadState, rate: float | None) -> ThreadState:
    """Fold one decode step's CPU rate (bytes/s; None: the step ran nothing on the CPU and says
    nothing) into the state; pure (the argument is not changed)."""
    if rate is not None and not 0.0 < rate < math.inf:
        raise ValueError(f"thread count: a step's CPU rate must be positive and finite, got {rate!r}")
    p = state.params
    state = replace(state, step=state.step + 1)
    if rate is None:
        return state
    rates = state.rates + (float(rate),)
    if len(rates) < p.window:
        return replace(state, rates=rates)
    median = sorted(rates)[(len(rates) - 1) // 2]
    state = replace(state, rates=())
    if state.probing:
        if median > state.home_rate * (1.0 + p.margin):
            lead = 1 if state.threads > state.home else -1
            moved = replace(state, home=state.threads, home_rate=median, failed=0, lead=lead, moves=state.moves + 1)
            return _probe(moved)
        failed = state.failed + 1
        if state.home == p.max_threads and failed >= p.max_threads - 1:  # a whole pass failed: settle
            return replace(state, threads=state.home, failed=failed, wait=1, reference=state.home_rate)
        return replace(state, threads=state.home, failed=failed, wait=min(failed, p.max_wait))
    if state.settled:
        if median * (1.0 + p.change) < state.reference:  # slower than it has been: search again
            return _probe(replace(state, home_rate=median, failed=0, reference=None))
        return replace(state, home_rate=median, reference=max(state.reference, median))
    changed = state.home_rate is not None and not (
        state.home_rate / (1.0 + p.change) <= median <= state.home_rate * (1.0 + p.change))
    state = replace(state, home_rate=median)
    if changed:
        return _probe(replace(state, failed=0))
    if state.wait > 1:
        return replace(state, wait=state.wait - 1)
    return _probe(state)


def threads_trace(start: int, rates: list[float | None], params: ThreadParams) -> list[int]:
    """The count after each step, from `start` through the steps' CPU rates in order."""
    state = initial_threads(start, params)
    out = []
    for rate in rates:
        state = next_threads(state, rate)
        out.append(state.threads)
    return out
