"""Simulated CPU workloads for the thread-count search's property tests (tests/property/test_thread_count*.py).

A workload is a landscape: the true CPU rate (bytes/s) of each count T in 1..C, C = max_threads. Kinds:
busy (B of C cores taken by another process: T <= C - B runs on free cores at min(T, cap) threads' worth,
cap the memory bandwidth's; above, the loop waits for the threads on busy cores at speed s: min(T * s, cap)),
free (busy with B = 0), flat (the bandwidth the limit), single-peaked, and any. A step at count T measures
its truth times a factor drawn in [1 - n, 1 + n]; a share of steps runs nothing on the CPU (rate None).
Notation as in test_thread_count.py: W, M, L, P(k), F.
"""

from __future__ import annotations

from hypothesis import strategies as st

from freetoken.reference.thread_count import ThreadParams, next_threads

units = st.floats(8.0, 10.0).map(lambda e: 10.0**e)  # one thread's bytes/s: 100 MB/s .. 10 GB/s
seeds = st.integers(0, 2**32)
idles = st.sampled_from([0.0, 0.0, 0.2])  # the chance of a step that ran nothing on the CPU
KINDS = ("busy", "flat", "peak", "any")


def least(n: float) -> float:
    """2n / (1 - n), a hair above: the least margin (and change) the noise n allows."""
    return 2 * n / (1 - n) * (1 + 1e-9)


@st.composite
def setups(draw, fewest: int = 1, most: int = 12):
    """(params, n): params whose margin and change are both >= 2n / (1 - n) for the noise n."""
    c = draw(st.integers(fewest, most))  # max_threads
    if draw(st.booleans()):  # the defaults and the noise they allow (margin 0.05: n <= 0.0243)
        return ThreadParams(c), draw(st.sampled_from([0.0, 0.0243]) | st.floats(0.0, 0.0243))
    n = draw(st.sampled_from([0.0, 0.1]) | st.floats(0.0, 0.1))
    slack = st.sampled_from([0.0, 0.01]) | st.floats(0.0, 0.5)
    params = ThreadParams(c, window=draw(st.integers(1, 6)), margin=max(least(n) + draw(slack), 1e-3),
                          max_wait=draw(st.integers(1, 8)), change=max(least(n) + draw(slack), 1e-3))
    return params, n


def busy(c: int, b: int, cap: int, s: float, unit: float) -> dict[int, float]:
    return {t: unit * (min(t, cap) if t <= c - b else min(t * s, cap)) for t in range(1, c + 1)}


@st.composite
def landscapes(draw, c: int, kind: str | None = None):
    kind = kind or draw(st.sampled_from(KINDS))
    unit = draw(units)
    if kind == "busy":
        return busy(c, draw(st.integers(0, c - 1)), draw(st.integers(1, c)), draw(st.floats(0.05, 0.9)), unit)
    if kind == "flat":
        return {t: unit for t in range(1, c + 1)}
    if kind == "peak":
        peak, fall = draw(st.integers(1, c)), draw(st.floats(0.01, 1.0))
        return {t: unit / (1 + fall * abs(t - peak)) for t in range(1, c + 1)}
    return {t: draw(units) for t in range(1, c + 1)}


@st.composite
def landscape_pairs(draw, c: int):
    """(before, after): a busy process starts, or stops, or any landscape becomes any other."""
    kind = draw(st.sampled_from(["starts", "stops", "any"]))
    if kind == "any" or c == 1:
        return draw(landscapes(c)), draw(landscapes(c))
    b, cap, s, unit = draw(st.integers(1, c - 1)), draw(st.integers(1, c)), draw(st.floats(0.05, 0.9)), draw(units)
    free, taken = busy(c, 0, cap, s, unit), busy(c, b, cap, s, unit)
    return (free, taken) if kind == "starts" else (taken, free)


def simulate(state, truth, steps, rng, n, idle=0.0):
    """Fold `steps` steps with a rate into state (before each, a None step at chance `idle`): the state after
    each rated step, and the count each ran at."""
    after, used = [], []
    while len(after) < steps:
        if rng.random() < idle:
            state = next_threads(state, None)
            continue
        used.append(state.threads)
        state = next_threads(state, truth[state.threads] * rng.uniform(1 - n, 1 + n))
        after.append(state)
    return after, used


def factor(params: ThreadParams, n: float) -> float:
    return (1 + params.margin) * (1 + n) / (1 - n)


def near_best(home: int, truth: dict[int, float], f: float) -> bool:
    return truth[home] * f * (1 + 1e-9) >= max(truth.values())


def settled_after(states, truth, f) -> int:
    """The fewest steps after which every state's home is within f of the best, to the run's end."""
    k = len(states)
    while k > 0 and near_best(states[k - 1].home, truth, f):
        k -= 1
    return k


def waits(k: int, m: int) -> int:
    """P(k): the windows of k failed probes from a move, each followed by min(failed, M) home windows."""
    return k + sum(min(f, m) for f in range(1, k + 1))


def pass_steps(params: ThreadParams) -> int:
    """A run's tail after a bound: one whole ladder pass at the longest waits, and a window."""
    return params.window * ((params.max_threads - 1) * (params.max_wait + 1) + 1)


def felt_busy_start(params: ThreadParams, n: float, data, unit: float):
    """(B, free, taken): B of C cores taken, where C - B beats every count above by more than F, and C's own
    rate falls by more than 1 + change can hide."""
    c = params.max_threads
    b = data.draw(st.integers(1, c - 1))
    s = data.draw(st.floats(0.05, 0.95)) * min((c - b) / (factor(params, n) * c),
                                               (1 - n) / ((1 + n) * (1 + params.change)))
    return b, busy(c, 0, c, s, unit), busy(c, b, c, s, unit)
