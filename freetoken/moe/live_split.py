"""The hybrid split while serving: the ratio word the planners read, the timings each step leaves,
and the estimator (reference/split_estimator.py) that turns them into the next step's ratio.

`SplitWord` is r as both planners read it: the twin takes the host's int, the plan kernel a
device int32 it loads when it runs, so a captured graph follows a new ratio without being
captured again. Every dynamic slot cache has one; only an adaptive hybrid split rewrites it.

`SplitTimings` collects what the step's paths already measured: the eager CPU branch's worker
time and the experts it read, the eager fills' host time (CPU device) or CUDA events (read once
they have completed, never waited for), and what a captured step's probe (engine/split_probe.py)
resolves from the device's counters and stamps. `LiveSplit.end_step` folds them into one
observation between steps, runs one estimator step and writes the word. Under `--moe-policy
auto` it also picks which of transfer, hybrid and cpu the split amounts to
(reference/auto_policy.py) and writes that policy's r.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from freetoken.reference.auto_policy import HYBRID, choose, word_for
from freetoken.reference.expert_cache import Q16, share_q16
from freetoken.reference.split_estimator import DEFAULT_PARAMS, SplitEstimate, SplitParams, StepTimings, prior, step
from freetoken.trace import NULL_RECORDER, TraceRecorder

TRACK = "moe_split"


class SplitWord:
    """The PCIe share r in Q16 (0..65536): the host's int and the device word, written together."""

    def __init__(self, q16: int, device: str | torch.device) -> None:
        _check_q16(q16)
        self.q16 = q16
        # (outside inference mode: forwards run in it, and the word is rewritten between them)
        with torch.inference_mode(False):
            self.word = torch.full((1,), q16, dtype=torch.int32, device=device)

    def set(self, q16: int) -> None:
        """A new r for the plans queued from now on (on CUDA: ordered on the current stream, so a
        replay queued after it reads it; no synchronisation)."""
        _check_q16(q16)
        if q16 != self.q16:
            self.word.fill_(q16)
            self.q16 = q16


def _check_q16(q16: int) -> None:
    if not 0 <= q16 <= Q16:
        raise ValueError(f"the split word holds r in Q16, 0..{Q16}; got {q16}")


class SplitTimings:
    """One step's measurements per path, as the step's code paths report them."""

    def __init__(self) -> None:
        self.pcie_bytes = 0
        self.pcie_s = 0.0
        self.cpu_bytes = 0
        self.cpu_s = 0.0
        # measurements still in flight: each call records what has completed and says whether
        # it is done (CUDA events of eager fills, a captured step's counters copied to the host)
        self._pending: list[Callable[[], bool]] = []

    def pcie(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.pcie_bytes += nbytes
            self.pcie_s += seconds

    def cpu(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.cpu_bytes += nbytes
            self.cpu_s += seconds

    def pcie_events(self, nbytes: int, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        """An eager fill timed by two CUDA events on the copy stream: read once `end` completed."""
        def resolve() -> bool:
            if not end.query():
                return False
            self.pcie(nbytes, start.elapsed_time(end) / 1e3)
            return True

        self._pending.append(resolve)

    def defer(self, resolve: Callable[[], bool]) -> None:
        """A measurement that lands later: `resolve()` records it once it can and returns True."""
        self._pending.append(resolve)

    def take(self) -> StepTimings:
        """What has landed since the last call (in-flight measurements stay for the next)."""
        self._pending = [resolve for resolve in self._pending if not resolve()]
        out = StepTimings(self.pcie_bytes, self.pcie_s, self.cpu_bytes, self.cpu_s)
        self.pcie_bytes = self.cpu_bytes = 0
        self.pcie_s = self.cpu_s = 0.0
        return out


class LiveSplit:
    """Hybrid's adaptive split: the estimate, the word it writes, the timings it reads.
    choosing: `auto`'s live choice among transfer, hybrid and cpu, kept in `choice` (None when
    not choosing: the word holds the estimator's r throughout)."""

    def __init__(self, word: SplitWord, pcie_bps: float, cpu_bps: float, source: str,
                 params: SplitParams = DEFAULT_PARAMS, recorder: TraceRecorder = NULL_RECORDER,
                 choosing: bool = False) -> None:
        self.word = word
        self.params = params
        self.source = source  # where the prior came from
        self.estimate: SplitEstimate = prior(pcie_bps, cpu_bps)
        self.timings = SplitTimings()
        self.trace = recorder
        self.choice: str | None = choose(HYBRID, self.estimate.ratio) if choosing else None
        self._write()

    def _write(self) -> None:
        r = self.estimate.ratio
        if self.choice is not None:
            self.choice = choose(self.choice, r)
            self.word.set(word_for(self.choice, r))
        else:
            self.word.set(share_q16(r))

    def end_step(self) -> None:
        """Between steps: fold what the last steps measured into the estimate and write the
        word for the next step's plans."""
        observed = self.timings.take()
        if observed.pcie_bytes == 0 and observed.cpu_bytes == 0 and self.estimate.ratio == self.estimate.target:
            return
        self.estimate = step(self.estimate, observed, self.params)
        self._write()
        if self.trace.enabled:
            self.trace.counter(TRACK, "pcie_share", self.estimate.ratio)
            self.trace.counter(TRACK, "word_share", self.word.q16 / Q16)  # what the plans read (auto: 0 or 1)
            self.trace.counter(TRACK, "pcie_fill_GBps", self.estimate.pcie_bps / 1e9)
            self.trace.counter(TRACK, "cpu_expert_GBps", self.estimate.cpu_bps / 1e9)

    def status(self) -> dict:
        e = self.estimate
        return {"adaptive": True, "ratio": self.word.q16 / Q16, "estimated_ratio": e.ratio, "target": e.target,
                "pcie_fill_Bps": e.pcie_bps, "cpu_expert_Bps": e.cpu_bps, "steps_observed": e.observed,
                "prior": self.source, "live_policy": self.choice}
