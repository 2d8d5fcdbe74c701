"""The live split: bandwidth estimates from each step's timings, and the PCIe share r they give.

The specification of what the engine's host-side split (moe/live_split.py) does between steps:
a pure step function from (estimate, one step's observation) to the next estimate.

Per step and per path (PCIe fills, CPU experts) one observation: the bytes the path moved and
the seconds it took; 0 bytes means the path was not used. A sample is the path's bandwidth
bytes / seconds. A path's fixed cost per layer (a hand-off, a launch) is in its seconds, so a
layer with few experts measures it slower per byte: the estimates are rates at the batch the
engine serves, which is what the split prices.

Smoothing: an exponentially weighted mean of log-bandwidth, each sample first clipped to within
a factor `clip` of the current estimate. Chosen over a windowed median because it keeps two
numbers of state instead of a window of history, reacts from the first step after a change
(a median of 2k+1 needs k+1 changed samples before it moves at all), and still bounds what one
sample can do: a single outlier, however wild, moves the estimate by at most a factor
clip ** alpha. Log space because bandwidths are compared as ratios, and a slow step (time up
5x) and a fast one (time down 5x) should pull equally hard.

A path the split has stopped using (the other path observed, this one not: at a small r, q*
fetches nothing for a layer's few misses) cannot show that it recovered. Once it has gone
`patience` such steps in a row unobserved, its estimate relaxes toward its prior by a fraction
`relax` of the log gap per further such step (bounded like a sample): the split tries it again.
The patience keeps a path that is used now and then (hybrid's recurring misses leave the CPU
a few experts some steps only) on its measurements. A step that observes neither path (every
route a hit) changes no estimate and no count.

The ratio comes from the estimates by the profile's own formula (`pcie_share`: r = B_pcie /
(B_pcie + B_cpu), reference/expert_cache.py), then moves toward that target by at most
`max_step` per step, so even a run of outliers swings the split gradually. The prior (before
any observation) is the bandwidth profile's pair, and r starts at its share.

Guarantees, tested under Hypothesis (tests/property/test_split_estimator.py):
- stability: r stays in [0, 1]; one step moves r by at most max_step, an estimate by at most a
  factor clip ** alpha;
- relaxation: a path left unused past its patience while the other runs returns to its
  prior; one used at least every `patience` steps keeps its measurements;
- convergence: bandwidths fixed anywhere in [MIN_BPS, MAX_BPS] and a prior anywhere in that
  range: r within 0.02 of the true share after CONVERGE_STEPS steps;
- tracking: from a settled state, one bandwidth changes by a factor up to TRACK_FACTOR either
  way: r within 0.02 of the new true share after TRACK_STEPS steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from freetoken.reference.expert_cache import pcie_share

MIN_BPS, MAX_BPS = 1e8, 1e12  # the bandwidths the guarantees are stated for (0.1 GB/s .. 1 TB/s)
CONVERGE_STEPS = 60
TRACK_STEPS = 20
TRACK_FACTOR = 4.0


@dataclass(frozen=True)
class SplitParams:
    alpha: float = 0.3  # weight of a new (clipped) log-bandwidth sample
    clip: float = 4.0  # a sample counts as at most this factor away from the estimate
    max_step: float = 0.05  # the most r moves in one step
    relax: float = 0.03  # a starved path's pull back to its prior, per step the other path is used
    patience: int = 32  # steps a path goes unobserved while the other is used before it relaxes

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha: the smoothing weight must be in (0, 1], got {self.alpha}")
        if self.clip <= 1.0:
            raise ValueError(f"clip: the outlier factor must exceed 1, got {self.clip}")
        if not 0.0 < self.max_step <= 1.0:
            raise ValueError(f"max_step: the bound on r's change per step must be in (0, 1], got {self.max_step}")
        if not 0.0 <= self.relax <= 1.0:
            raise ValueError(f"relax: the pull back to the prior must be in [0, 1], got {self.relax}")
        if self.patience < 0:
            raise ValueError(f"patience: a step count, >= 0; got {self.patience}")


DEFAULT_PARAMS = SplitParams()


@dataclass(frozen=True)
class StepTimings:
    """One step's measurements: bytes over each path and the seconds they took (0 bytes: unused)."""

    pcie_bytes: int = 0
    pcie_s: float = 0.0
    cpu_bytes: int = 0
    cpu_s: float = 0.0

    def __post_init__(self) -> None:
        for path in ("pcie", "cpu"):
            nbytes, seconds = getattr(self, f"{path}_bytes"), getattr(self, f"{path}_s")
            if nbytes < 0 or seconds < 0 or not math.isfinite(seconds):
                raise ValueError(f"{path}: bytes and seconds must be finite and >= 0, got {nbytes} B in {seconds} s")
            if nbytes > 0 and seconds <= 0:
                raise ValueError(f"{path}: {nbytes} B moved in no time; an unused path has 0 bytes")


@dataclass(frozen=True)
class SplitEstimate:
    pcie_bps: float  # PCIe fill bandwidth estimate, bytes/s
    cpu_bps: float  # CPU expert bandwidth estimate, bytes/s
    ratio: float  # the PCIe share r in force, in [0, 1]
    prior_pcie_bps: float  # the profile's figures, where an unused path's estimate relaxes to
    prior_cpu_bps: float
    observed: int = 0  # steps that carried at least one observation
    pcie_starved: int = 0  # steps in a row the CPU path was observed and PCIe not
    cpu_starved: int = 0  # and the other way round

    @property
    def target(self) -> float:
        """The share the estimates ask for (r moves toward it)."""
        return pcie_share(self.pcie_bps, self.cpu_bps)


def prior(pcie_bps: float, cpu_bps: float) -> SplitEstimate:
    """The state before any observation: the profile's bandwidths and their share."""
    if not (pcie_bps > 0 and cpu_bps > 0 and math.isfinite(pcie_bps) and math.isfinite(cpu_bps)):
        raise ValueError(f"prior bandwidths must be positive and finite, got PCIe {pcie_bps}, CPU {cpu_bps}")
    return SplitEstimate(pcie_bps, cpu_bps, pcie_share(pcie_bps, cpu_bps), pcie_bps, cpu_bps)


def _smooth(estimate: float, nbytes: int, seconds: float, starved: int, prior_bps: float,
            p: SplitParams) -> float:
    log_est, bound = math.log(estimate), p.alpha * math.log(p.clip)
    if nbytes > 0:
        pull = p.alpha * (math.log(nbytes / seconds) - log_est)
    elif starved > p.patience:
        pull = p.relax * (math.log(prior_bps) - log_est)
    else:
        return estimate
    return math.exp(log_est + min(max(pull, -bound), bound))


def _starved(count: int, used: bool, other_used: bool) -> int:
    return 0 if used else count + 1 if other_used else count


def step(state: SplitEstimate, timings: StepTimings, params: SplitParams = DEFAULT_PARAMS) -> SplitEstimate:
    """The estimate after one more step's timings."""
    used_pcie, used_cpu = timings.pcie_bytes > 0, timings.cpu_bytes > 0
    pcie_starved = _starved(state.pcie_starved, used_pcie, used_cpu)
    cpu_starved = _starved(state.cpu_starved, used_cpu, used_pcie)
    pcie = _smooth(state.pcie_bps, timings.pcie_bytes, timings.pcie_s, pcie_starved, state.prior_pcie_bps, params)
    cpu = _smooth(state.cpu_bps, timings.cpu_bytes, timings.cpu_s, cpu_starved, state.prior_cpu_bps, params)
    target = pcie_share(pcie, cpu)
    ratio = min(max(target, state.ratio - params.max_step), state.ratio + params.max_step)
    ratio = min(max(ratio, 0.0), 1.0)
    seen = state.observed + (used_pcie or used_cpu)
    return SplitEstimate(pcie, cpu, ratio, state.prior_pcie_bps, state.prior_cpu_bps, seen, pcie_starved,
                         cpu_starved)


def run(start: SplitEstimate, history: Iterable[StepTimings], params: SplitParams = DEFAULT_PARAMS) -> SplitEstimate:
    """The estimate after a whole timing history."""
    state = start
    for timings in history:
        state = step(state, timings, params)
    return state
