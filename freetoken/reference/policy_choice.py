"""`--moe-policy auto` choosing among transfer, hybrid and cpu while it serves: the specification.

Why measured step times and not a cost model: the live split's estimates (reference/adaptive_split.py)
say how fast each link moves expert bytes, and hybrid already divides a layer's misses by them.
What they do not say is what each policy's fixed costs are: a CPU hand-off's latency per layer
(transfer has none), a fill's wait (cpu has none), the fills hybrid adds in the background
competing for the link, or what a frozen cache (cpu) costs once routing drifts. Those decide
between the three at the margins, and they change with the machine's load. So the chooser runs
each mode for a few steps (a probe) and keeps the fastest by median step time; the estimates and
the hit rate tell it when the machine or the workload changed enough to probe again.

The three modes are one plan with three shares (kernels/triton/plan.py, twin reference/expert_cache.py):
hybrid's rule at r = 1 fetches and waits for every miss, exactly transfer's plan, and at r = 0
fetches none, exactly cpu's (tests/property/test_policy_choice.py checks both on the planner).
So a mode switch is a new share written between two steps; a captured decode graph reads it when
it runs, and nothing is recaptured.

The machine (pure: no clock, no threads; the engine's wiring is moe/live_policy.py):
- warm-up: the first `warmup` steps run hybrid unmeasured (a cold cache makes every mode slow,
  and whichever mode went first would warm it for the others);
- probe: the incumbent mode is measured first (no switch), then the others; each mode's first
  `settle` steps are not measured (the previous mode's fills still land), the next `measure`
  clean steps at the probe's batch size give its median (steps at another size are not
  measured). A mode that gets too few within `patience` steps is judged on those it got, or
  skipped with none;
- choice: the fastest median, unless the incumbent's is within `margin` of it (hysteresis);
- exploit: the chosen mode runs; a probe starts again after `period` steps, or when over the
  last `window` steps (i) the mode's median step time rose by more than `drift` over its probe
  median at the same batch size, (ii) the hit rate's median moved by more than `hit_shift`,
  (iii) in hybrid (the one mode that samples both links), with a live split, the estimates'
  target share moved by more than `shift`, or (iv) every step ran at a batch size other than the probe's.
  In transfer or cpu mode one link is idle and its estimate is a held value or the split's
  optimistic probe, not a measurement, so the target is not watched there;
- back-off: each probe started by (i)-(iv) (a watched probe) doubles the wait before the watch
  looks again: it looks only from `holdoff` = `window * 2**k` steps after a choice, k the
  back-off count, which stops at `doublings` (so a long noisy spell is forgotten in as many calm
  hold-offs), and never later than `period`; each `holdoff` steps the watch looks without firing
  take one from k. The warm-up's and the period's probes leave k.
  Why: on a machine whose steps are noisier than `drift` can tell apart (a shared desktop; a
  small model's few lookups a step move the hit rate by tens of points), the watch fires every
  few windows, and a probe among modes that noise orders at random switches as often as not,
  so neither the outcome nor one step tells noise from a change; the rate of firings does. A
  machine that changes once is watched within `window` steps again after a calm spell.

Guarantees (tests/property/test_policy_choice.py), with per-mode step times fixed up to a noise
factor in [1 - n, 1 + n]: the mode chosen by a probe is within (1 + n) / (1 - n) / (1 - margin)
of the fastest mode; outside probes the chosen mode runs; a probe takes 3 * (settle + measure)
steps, 2 * (settle + measure) of them in the modes it does not start in, and when nothing
changes (n <= drift / (2 + drift)) one comes every `period` steps;
after the chosen mode slows by more than (1 + drift)(1 + n)/(1 - n), a probe starts within
`holdoff` steps of the choice or `window` steps of the slowing, whichever is later (`holdoff`:
`window` at k = 0, at most H = `window * 2**doublings`), and the new choice obeys the first
bound; at any noise, a watched probe comes at least `holdoff` steps after the choice before it
and raises k by one, and only `holdoff` calm steps lower it, so while the watch keeps firing
the probes hold at most 3 * (settle + measure) of every H + 3 * (settle + measure) steps once
k reaches `doublings`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from freetoken.reference.expert_cache import Q16

HYBRID, TRANSFER, CPU = "hybrid", "transfer", "cpu"
MODES = (HYBRID, TRANSFER, CPU)


def mode_ratio_q16(mode: str, hybrid_q16: int) -> int:
    """The share a step of `mode` plans with: hybrid's own (the live split's), or the ends."""
    if mode == HYBRID:
        return hybrid_q16
    if mode == TRANSFER:
        return Q16
    if mode == CPU:
        return 0
    raise ValueError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")


@dataclass(frozen=True)
class ChoiceParams:
    warmup: int = 32  # steps of hybrid before the first probe
    settle: int = 2  # steps of a newly set mode that are not measured
    measure: int = 5  # clean steps measured per mode in a probe (their median judges it)
    patience: int = 40  # steps a probed mode gets after settling (then judged on its clean steps, or skipped)
    margin: float = 0.03  # another mode replaces the incumbent only if this share faster
    period: int = 1024  # steps between probes when nothing changes (~2% of steps in the modes not chosen)
    window: int = 9  # recent steps watched between probes
    drift: float = 0.2  # the chosen mode's median step time rising this share above its probe's
    hit_shift: float = 0.15  # the hit rate's median moving this far from the probe's
    shift: float = 0.15  # hybrid: the estimates' target share moving this far from the probe's
    doublings: int = 5  # the back-off's cap: the watch waits at most window * 2**doublings steps (288)

    def __post_init__(self) -> None:
        for name in ("warmup", "settle", "doublings"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"policy choice: {name} must be an int >= 0, got {getattr(self, name)!r}")
        for name in ("measure", "patience", "period", "window"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"policy choice: {name} must be an int >= 1, got {getattr(self, name)!r}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"policy choice: margin must be in [0, 1), got {self.margin!r}")
        for name in ("drift", "hit_shift", "shift"):
            if not getattr(self, name) > 0.0:
                raise ValueError(f"policy choice: {name} must be > 0, got {getattr(self, name)!r}")
        if self.period <= 2 * len(MODES) * (self.settle + self.measure):
            raise ValueError(f"policy choice: period ({self.period}) must exceed two probes' steps "
                             f"({2 * len(MODES) * (self.settle + self.measure)})")


@dataclass(frozen=True)
class StepTiming:
    """One decode step as the engine saw it: its wall time (None when it was not a clean step:
    the first after a prefill, a resize, or an idle engine), its batch size, the live split's
    target share after it, and its hit rate (None: no lookups)."""

    ns: int | None
    rows: int
    target: float
    hit_rate: float | None

    def __post_init__(self) -> None:
        if self.ns is not None and not self.ns > 0:
            raise ValueError(f"a step's time must be > 0 ns, got {self.ns}")
        if self.rows < 1:
            raise ValueError(f"a step has at least one row, got {self.rows}")
        if not 0.0 <= self.target <= 1.0 or (self.hit_rate is not None and not 0.0 <= self.hit_rate <= 1.0):
            raise ValueError(f"target share and hit rate must be in [0, 1], got {self.target}, {self.hit_rate}")


def _median(values) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]  # the lower median: always a measured value


@dataclass(frozen=True)
class Measured:
    """A probed mode's medians over its clean steps."""

    ns: float
    hit_rate: float | None
    target: float


def _measured(samples: tuple[StepTiming, ...]) -> Measured:
    hits = [t.hit_rate for t in samples if t.hit_rate is not None]
    return Measured(_median(t.ns for t in samples), _median(hits) if hits else None,
                    _median(t.target for t in samples))


@dataclass(frozen=True)
class ChoiceState:
    params: ChoiceParams
    mode: str = HYBRID  # what the next step runs
    step: int = 0
    queue: tuple[str, ...] = ()  # a probe's modes still to measure, the current one first; () outside probes
    incumbent: str = HYBRID  # the mode chosen before the probe
    rows: int | None = None  # the batch size the probe measures (and the choice holds for)
    since_set: int = 0  # steps run in `mode` since it was set
    samples: tuple[StepTiming, ...] = ()  # the current probed mode's clean steps
    measured: tuple[tuple[str, Measured], ...] = ()  # this probe's modes so far; after it, its result
    reference: Measured | None = None  # the chosen mode's, at the choice
    recent: tuple[StepTiming, ...] = ()  # the last `window` steps since the choice
    since_choice: int = 0
    probes: int = 0
    switches: int = 0  # choices that changed the mode
    last_reason: str = "warm-up"
    backoff: int = 0  # the back-off's k: watched probes, less the calm spells since (at most `doublings`)
    calm: int = 0  # steps the watch has looked without firing since the choice or since k last fell
    history: tuple[tuple[int, str], ...] = ()  # (step, mode) at each choice, the last 32

    @property
    def probing(self) -> bool:
        return bool(self.queue)

    @property
    def holdoff(self) -> int:
        """Steps after a choice before the watch looks (the back-off)."""
        p = self.params
        return min(p.window << self.backoff, p.period)


UNWATCHED = ("warm-up over", "period")  # the probes that do not come from the watch


def initial_choice(params: ChoiceParams | None = None) -> ChoiceState:
    return ChoiceState(params or ChoiceParams())


def _start_probe(state: ChoiceState, reason: str, rows: int) -> ChoiceState:
    order = (state.mode,) + tuple(m for m in MODES if m != state.mode)
    return replace(state, queue=order, incumbent=state.mode, rows=rows, samples=(), measured=(),
                   since_set=0, recent=(), probes=state.probes + 1, last_reason=reason,
                   backoff=min(state.backoff + (reason not in UNWATCHED), state.params.doublings))


def _next_probed(state: ChoiceState) -> ChoiceState:
    """The current probed mode is done (no clean step: skipped); move to the next or choose."""
    measured = state.measured + (((state.queue[0], _measured(state.samples)),) if state.samples else ())
    queue = state.queue[1:]
    if queue:
        return replace(state, mode=queue[0], queue=queue, measured=measured, samples=(), since_set=0)
    times = {mode: m.ns for mode, m in measured}
    chosen = state.incumbent
    if times:
        best = min(times, key=lambda m: (times[m], MODES.index(m)))
        if state.incumbent not in times or times[best] < times[state.incumbent] * (1.0 - state.params.margin):
            chosen = best
    history = (state.history + ((state.step, chosen),))[-32:]
    return replace(state, mode=chosen, queue=(), measured=measured, samples=(), calm=0,
                   since_set=0 if chosen != state.mode else state.since_set, reference=dict(measured).get(chosen),
                   recent=(), since_choice=0, history=history, switches=state.switches + (chosen != state.incumbent))


def _probe_step(state: ChoiceState, timing: StepTiming) -> ChoiceState:
    p = state.params
    # (a step at another batch size does not compare with the probe's: not measured)
    if timing.ns is not None and timing.rows == state.rows and state.since_set > p.settle:
        state = replace(state, samples=state.samples + (timing,))
    if len(state.samples) >= p.measure or state.since_set >= p.settle + p.patience:
        return _next_probed(state)  # (out of patience: judged on the clean steps it had, or skipped)
    return state


def _exploit_step(state: ChoiceState, timing: StepTiming) -> ChoiceState:
    p = state.params
    recent = (state.recent + (timing,))[-p.window:]
    state = replace(state, recent=recent, since_choice=state.since_choice + 1)
    if state.since_choice >= p.period:
        return _start_probe(state, "period", timing.rows)
    if len(recent) < p.window or state.since_choice < state.holdoff or state.reference is None:
        return state
    ref = state.reference
    if not any(t.rows == state.rows for t in recent):
        return _start_probe(state, "batch size changed", timing.rows)
    same_rows = [t.ns for t in recent if t.rows == state.rows and t.ns is not None]
    if len(same_rows) * 2 > p.window and _median(same_rows) > ref.ns * (1.0 + p.drift):
        return _start_probe(state, "slower steps", timing.rows)
    hits = [t.hit_rate for t in recent if t.hit_rate is not None]
    if ref.hit_rate is not None and len(hits) * 2 > p.window and abs(_median(hits) - ref.hit_rate) > p.hit_shift:
        return _start_probe(state, "hit rate moved", timing.rows)
    if state.mode == HYBRID and abs(_median(t.target for t in recent) - ref.target) > p.shift:
        return _start_probe(state, "link estimates moved", timing.rows)
    if state.calm + 1 >= state.holdoff and state.backoff:  # a calm spell: one doubling undone
        return replace(state, backoff=state.backoff - 1, calm=0)
    return replace(state, calm=state.calm + 1)


def next_choice(state: ChoiceState, timing: StepTiming) -> ChoiceState:
    """Fold the step just run (in `state.mode`) into the state; its `mode` is what the next step
    runs. Pure (the argument is not changed)."""
    state = replace(state, step=state.step + 1, since_set=state.since_set + 1)
    if state.probing:
        return _probe_step(state, timing)
    if state.probes == 0:  # warming up
        return _start_probe(state, "warm-up over", timing.rows) if state.step >= state.params.warmup else state
    return _exploit_step(state, timing)


def mode_trace(steps, params: ChoiceParams | None = None) -> list[str]:
    """The mode each step ran in; `steps` yields one callable per step, mode -> StepTiming (a
    simulated machine)."""
    state = initial_choice(params)
    out = []
    for step_of in steps:
        out.append(state.mode)
        state = next_choice(state, step_of(state.mode))
    return out
