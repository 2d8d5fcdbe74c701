"""The hybrid split's PCIe share r, following the machine while it serves: the specification.

Why: hybrid splits each MoE layer's misses between PCIe fills and CPU experts by
r = pcie_share(B_pcie, B_cpu) (reference/expert_cache.py). A profile measured once (`bench bw`)
goes wrong as soon as another process takes PCIe bandwidth or CPU cores (issue 34). The engine
already times its own work (cache/live_bandwidth.py): a layer's fill is a `pcie_fill` sample,
a CPU expert call a `cpu_expert` sample, each (bytes, ns). Once per decode step the engine hands
that step's samples to `next_state`; the state's `ratio_q16` is the r the next step plans with.
This module is a pure function of (profile, samples): no clock, no threads, no mutation, so the
engine's wiring can be replayed and checked against it step by step.

Estimate of a link: a step's rate is its samples' bytes over their time (a big fill weighs more
than a small one); the estimate is the lower median of the rates of the last `window` steps
that had samples. A median is a rank statistic: it is the same in log space as in linear space,
so there is no scale to tune (rates span 1e8 to 1e11 B/s across machines), and one step the OS
descheduled, or one warm-up fill, moves it by at most one rank, however wild that step is: the
estimate stays inside the range of the other steps' rates (an EWMA, even clipped, is dragged by
every outlier and needs a clip width). The lower median is always one of the measured rates.
Until `min_samples` steps have samples the profile's figure stands in.

Bounded change: r moves toward pcie_share(estimates) by at most `max_step` per step, and lands
exactly on it when within reach, so no single slow step can swing the split.

Starvation: r near 0 plans no fills (q* fetches none), r near 1 sends no expert to the CPU; the
unused link then gets no samples and its estimate goes stale: it would stay at whatever slowed it
down, and the split would never come back when that load went away. A stale estimate is held,
never decayed. After `stale_steps` steps without a sample its window is dropped (those rates
describe a machine that may have changed) and, while the other link keeps being sampled, it is
raised optimistically by `probe_growth` per step, up to `probe_cap` times the other link's
estimate. The target r then drifts toward the stale link until the planner gives it work again;
its first `min_samples` steps of fresh samples replace the guess. If the link is still slow the
split goes back, and the probe recurs every `stale_steps` steps or so. While the ratio is below
the planner's first fetch the probe costs nothing; it costs a few steps of one misplaced expert
where it crosses it. The probe needs no trust in the profile (which may be a default, or from
another load). With both links idle (every route a hit) nothing is known and everything is held.
With probe_growth <= ((1 + max_step) / (1 - max_step))**2 (the defaults: 1.2 <= 1.22) the
target rises at most max_step per step while probing, so r follows it without lag.

Guarantees (tests/property/test_adaptive_split.py): |r_t - r_(t-1)| <= max_step; with both links
sampled each step and exact samples, r equals the true share within min_samples +
ceil(|r0 - r*| / max_step) steps and stays; after the true bandwidths change, within
floor(window / 2) + 1 + ceil(|change of r*| / max_step) steps (15 with the defaults for a change
of 0.5); one outlier step leaves r inside the band the noise alone allows (and, without noise,
does not move it); a starved link that becomes faster is found again, within stale_steps + the
probe's growth steps + min_samples + ceil(1 / max_step) + 3 steps (the growth steps: log base
probe_growth of how far its estimate must rise before q* gives it work).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from freetoken.reference.expert_cache import pcie_share, share_q16


@dataclass(frozen=True)
class SplitParams:
    window: int = 8  # steps with samples whose rates the median reads
    min_samples: int = 3  # of those, before the estimate replaces the profile's figure (>= 3: one outlier is outvoted)
    max_step: float = 0.05  # the most r moves in one step
    stale_steps: int = 32  # steps without a sample after which a link's estimate is stale
    probe_growth: float = 1.2  # a stale estimate's rise per step, while the other link is sampled
    probe_cap: float = 4.0  # a stale estimate rises to at most this times the other link's

    def __post_init__(self) -> None:
        for name in ("window", "min_samples", "stale_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"adaptive split: {name} must be an int >= 1, got {value!r}")
        if self.min_samples > self.window:
            raise ValueError(f"adaptive split: min_samples ({self.min_samples}) must be <= window ({self.window})")
        if not 0.0 < self.max_step <= 1.0:
            raise ValueError(f"adaptive split: max_step must be in (0, 1], got {self.max_step!r}")
        if not 1.0 < self.probe_growth < math.inf:
            raise ValueError(f"adaptive split: probe_growth must be > 1 and finite, got {self.probe_growth!r}")
        if not 1.0 <= self.probe_cap < math.inf:
            raise ValueError(f"adaptive split: probe_cap must be >= 1 and finite, got {self.probe_cap!r}")


def _pairs(link: str, samples: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out = []
    for nbytes, ns in samples:
        if not (0 <= nbytes < math.inf and 0 <= ns < math.inf):
            raise ValueError(f"a {link} sample needs finite bytes >= 0 and ns >= 0, got {nbytes} bytes in {ns} ns")
        out.append((nbytes, ns))
    return tuple(out)


@dataclass(frozen=True)
class StepSamples:
    """One decode step's timed work per link, (bytes, ns) each; either may be empty. A sample of
    zero bytes or zero time says nothing about a rate and is ignored; a negative one is refused."""

    pcie_fill: tuple[tuple[int, int], ...] = ()
    cpu_expert: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "pcie_fill", _pairs("pcie_fill", self.pcie_fill))
        object.__setattr__(self, "cpu_expert", _pairs("cpu_expert", self.cpu_expert))


def step_rate(samples: Iterable[tuple[int, int]]) -> float | None:
    """The step's rate of one link in bytes/s: its samples' bytes over their ns; None when no
    sample moved bytes in a nonzero time."""
    useful = [(b, ns) for b, ns in samples if b > 0 and ns > 0]
    if not useful:
        return None
    return sum(b for b, _ in useful) * 1e9 / sum(ns for _, ns in useful)


@dataclass(frozen=True)
class LinkState:
    estimate: float  # bytes/s: the lower median of `rates`, the profile's figure, or a held/probed value
    rates: tuple[float, ...] = ()  # the last <= window step rates, oldest first (dropped when stale)
    idle: int = 0  # steps since the last one with samples


def _lower_median(values: tuple[float, ...]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


def _next_link(link: LinkState, rate: float | None, other: LinkState, other_idle: int,
               params: SplitParams) -> LinkState:
    if rate is not None:
        rates = (link.rates + (rate,))[-params.window:]
        estimate = _lower_median(rates) if len(rates) >= params.min_samples else link.estimate
        return LinkState(estimate, rates, 0)
    idle = link.idle + 1
    if idle < params.stale_steps:
        return LinkState(link.estimate, link.rates, idle)
    estimate = link.estimate
    if other_idle < params.stale_steps:  # the other link is in use: probe this one
        estimate = max(estimate, min(estimate * params.probe_growth, params.probe_cap * other.estimate))
    return LinkState(estimate, (), idle)


@dataclass(frozen=True)
class SplitState:
    params: SplitParams
    pcie: LinkState
    cpu: LinkState
    ratio: float  # r in [0, 1]: the PCIe share the next step plans with
    step: int = 0  # steps folded in

    @property
    def target(self) -> float:
        """Where r is heading: pcie_share of the two estimates."""
        return pcie_share(self.pcie.estimate, self.cpu.estimate)

    @property
    def ratio_q16(self) -> int:
        """r in the plan's Q16 fixed point (share_q16)."""
        return share_q16(self.ratio)


def initial_state(pcie_bps: float, cpu_bps: float, params: SplitParams | None = None) -> SplitState:
    """The state before any sample: both estimates are the profile's figures (bytes/s, each
    positive and finite) and r is their share."""
    for name, value in (("pcie_bps", pcie_bps), ("cpu_bps", cpu_bps)):
        if not 0.0 < value < math.inf:
            raise ValueError(f"adaptive split: the profile's {name} must be positive and finite, got {value!r}")
    params = SplitParams() if params is None else params
    pcie, cpu = LinkState(float(pcie_bps)), LinkState(float(cpu_bps))
    return SplitState(params, pcie, cpu, pcie_share(pcie.estimate, cpu.estimate))


def next_state(state: SplitState, samples: StepSamples) -> SplitState:
    """Fold one decode step's samples into the state; pure (the argument is not changed)."""
    params = state.params
    pcie_rate, cpu_rate = step_rate(samples.pcie_fill), step_rate(samples.cpu_expert)
    pcie_idle = 0 if pcie_rate is not None else state.pcie.idle + 1
    cpu_idle = 0 if cpu_rate is not None else state.cpu.idle + 1
    pcie = _next_link(state.pcie, pcie_rate, state.cpu, cpu_idle, params)
    cpu = _next_link(state.cpu, cpu_rate, state.pcie, pcie_idle, params)
    target = pcie_share(pcie.estimate, cpu.estimate)
    delta = target - state.ratio
    if abs(delta) <= params.max_step:
        ratio = target
    else:
        ratio = state.ratio + math.copysign(params.max_step, delta)
    return SplitState(params, pcie, cpu, ratio, state.step + 1)


def ratio_trace(prior: tuple[float, float], steps: Iterable[StepSamples],
                params: SplitParams | None = None) -> list[float]:
    """r after each step, from the profile's (pcie_bps, cpu_bps) through `steps` in order."""
    state = initial_state(prior[0], prior[1], params)
    out = []
    for samples in steps:
        state = next_state(state, samples)
        out.append(state.ratio)
    return out

