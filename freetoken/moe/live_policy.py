"""`--moe-policy auto` choosing among transfer, hybrid and cpu while it serves: the engine's side
of reference/policy_choice.py.

The engine runs hybrid's plan throughout; a mode is the share it plans with (transfer: 1, cpu: 0,
hybrid: hybrid's own, the profile's r or, with `--moe-param adaptive=true`, the live split's; the
twin's docstring says why the ends are exactly those policies' plans). Each decode step is timed
from its start to the next step's start, the whole period a user waits per token; a step followed
by other work (a prefill, a resize) is not clean and is not measured. At each step's start the
previous step's timing and hit rate go to the twin's `next_choice`, and the mode it returns sets
the share this step plans with: switches happen only between steps, and a captured graph reads
the share when it runs (nothing is recaptured).

Only the arithmetic is the twin's; this module adds the clock, the per-step hit rate from the
cache counters (in graph mode one small device read per step) and the status for /metrics, the
status endpoint and the trace.
"""

from __future__ import annotations

import time

from freetoken.moe.live_split import LiveSplit
from freetoken.reference.policy_choice import (
    MODES,
    ChoiceParams,
    StepTiming,
    initial_choice,
    mode_ratio_q16,
    next_choice,
)
from freetoken.trace import NULL_RECORDER, TraceRecorder

TRACK = "moe_policy"  # the trace's track: probes and choices as instants, shares and mode (0 hybrid,
# 1 transfer, 2 cpu, MODES' order) as counters per step


class LivePolicyChoice:
    """Called from the step's thread only: `begin_step`, `end_step`, `interrupt`."""

    def __init__(self, cache, split: LiveSplit | None, hybrid_q16: int, params: ChoiceParams | None = None,
                 recorder: TraceRecorder = NULL_RECORDER) -> None:
        self.cache = cache  # the slot cache: the share the plans read, and the hit counters
        # hybrid mode's share: the live split's (hybrid's `adaptive=true`), else the profile's
        # (or the `ratio` parameter's) throughout; the split's estimates also feed the twin's target
        self.split, self.hybrid_q16 = split, hybrid_q16
        self.sync_stats = lambda: None  # graph mode: the runner brings the device's counters to the host
        self.state = initial_choice(params or ChoiceParams())
        self.recorder = recorder
        self._start_ns: int | None = None  # the running step's start
        self._rows = 0
        self._clean = False
        self._lookups = self._looked_up()
        self.mode_steps = dict.fromkeys(MODES, 0)  # steps run in each mode since start
        self._apply()

    def _hybrid_q16(self) -> int:
        return self.hybrid_q16 if self.split is None else self.split.state.ratio_q16

    def _target(self) -> float:
        return self.hybrid_q16 / 65536 if self.split is None else self.split.state.target

    def _apply(self) -> None:
        q16 = mode_ratio_q16(self.state.mode, self._hybrid_q16())
        if self.cache.ratio_q16 != q16:  # (a device word: written only when it changes)
            self.cache.set_ratio_q16(q16)

    def _looked_up(self) -> tuple[int, int]:
        return sum(self.cache.stats.hits), sum(self.cache.stats.misses)

    def interrupt(self) -> None:
        """Work that is not a decode step ran since the last one: that step's period is not clean."""
        self._clean = False
        if self.split is not None:
            self.split.interrupt()

    def begin_step(self, rows: int) -> None:
        """A decode step of `rows` sequences starts: the last step's period is folded, and this
        step plans with the mode the twin returns."""
        if self.split is not None:
            self.split.begin_step(rows)
        now = time.perf_counter_ns()
        self.sync_stats()
        counts = self._looked_up()
        if self._start_ns is not None:
            # (an unclean period holds other work's lookups too, a prefill's: neither its time nor its hit rate)
            clean = self._clean and now > self._start_ns
            hits, lookups = counts[0] - self._lookups[0], sum(counts) - sum(self._lookups)
            timing = StepTiming(now - self._start_ns if clean else None, self._rows, self._target(),
                                hits / lookups if clean and lookups else None)
            before = self.state
            self.state = next_choice(before, timing)
            if self.state.probes != before.probes:
                self.recorder.instant(TRACK, "probe", reason=self.state.last_reason, step=self.state.step)
            if before.probing and not self.state.probing:
                self.recorder.instant(TRACK, "choice", mode=self.state.mode, step=self.state.step,
                                      medians_ms={m: round(x.ns / 1e6, 3) for m, x in self.state.measured})
        self._lookups = counts
        self._start_ns, self._rows, self._clean = now, rows, True
        self.mode_steps[self.state.mode] += 1
        self._apply()
        if self.recorder.enabled:  # (the trace shows how the share and the mode settle after a change)
            self.recorder.counter(TRACK, "pcie_share", self.ratio)
            self.recorder.counter(TRACK, "hybrid_share", self._hybrid_q16() / 65536)
            self.recorder.counter(TRACK, "mode", MODES.index(self.state.mode))

    def end_step(self) -> None:
        """The step's link samples fold into the live split's estimates, if there is one; the
        share stays this step's until the next `begin_step` chooses."""
        if self.split is not None:
            self.split.fold()

    @property
    def mode(self) -> str:
        return self.state.mode

    @property
    def ratio(self) -> float:
        """The PCIe share the running mode plans with."""
        return mode_ratio_q16(self.state.mode, self._hybrid_q16()) / 65536

    def status(self) -> dict:
        s = self.state
        return {
            "mode": s.mode,
            "probing": s.probing,
            "steps": s.step,
            "probes": s.probes,
            "switches": s.switches,
            "backoff": s.backoff,  # the watch's back-off count: watched probes less calm spells
            "holdoff_steps": s.holdoff,  # steps after a choice before the watch looks again
            "last_reason": s.last_reason,
            "mode_steps": dict(self.mode_steps),
            "last_probe_ms": {m: round(x.ns / 1e6, 3) for m, x in s.measured},
            "recent_choices": [[step, mode] for step, mode in s.history],
            "params": {f: getattr(s.params, f) for f in s.params.__dataclass_fields__},
        }
