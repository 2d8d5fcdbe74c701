"""Hybrid's split following the machine while it serves: the engine's side of
reference/adaptive_split.py.

The work the engine times anyway arrives here as it is timed (cache/live_bandwidth.py forwards
every sample: an eager layer's fill or CPU call, a captured step's fills over their device stamps
and its CPU answers over the poller's stamps). At each decode step's end, `end_step` hands that
step's samples to the twin's `next_state`, and the slot cache plans the next step with the new
share: its host int for eager plans, its device word for captured ones (kernels/triton/plan.py
reads it when the graph runs). Prefill chunks' samples are dropped at the next step's end: a
streamed prefill moves whole layers, not the misses the split divides.

Only the arithmetic is the twin's; this module adds the bookkeeping (thread-safe collection, the
live cache after a resize, a status and a short history for the trace and /metrics).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from freetoken.reference.adaptive_split import SplitParams, SplitState, StepSamples, initial_state, next_state

HISTORY = 256  # (step, r) pairs kept for the status: enough to see a change settle


class LiveSplit:
    """The split's state; `record` from any thread, `end_step` from the step's thread."""

    def __init__(self, backend, pcie_bps: float, cpu_bps: float, params: SplitParams | None = None) -> None:
        self.backend = backend  # OffloadedExperts: `cache` is the live slot cache (a resize replaces it)
        self.state: SplitState = initial_state(pcie_bps, cpu_bps, params)
        self.prior = (pcie_bps, cpu_bps)
        self._pending: dict[str, list[tuple[int, int]]] = {"pcie_fill": [], "cpu_expert": []}
        self._lock = threading.Lock()
        self.history: deque[tuple[int, float]] = deque(maxlen=HISTORY)
        self.changes = 0  # steps that moved the planner's share
        self.on_step: Callable[[StepSamples], None] | None = None  # each step's samples, also (moe/live_threads.py)
        backend.live.listener = self.record
        backend.cache.set_ratio_q16(self.state.ratio_q16)

    def record(self, link: str, nbytes: int, ns: int) -> None:
        with self._lock:
            self._pending[link].append((nbytes, ns))

    def drop_pending(self) -> None:
        """Forget samples not yet folded (work that is not a decode step's: a prefill, a warm-up)."""
        with self._lock:
            for samples in self._pending.values():
                samples.clear()

    def begin_step(self, rows: int) -> None:
        """A decode step of `rows` sequences starts: what came since the last one is not its work."""
        self.drop_pending()

    def interrupt(self) -> None:
        """Work that is not a decode step ran (a prefill, a resize): its samples are dropped at
        the next step's start anyway."""

    def end_step(self) -> None:
        """Fold this step's samples into the state; the next plan uses the new share."""
        self.fold()
        self.apply(self.state.ratio_q16)

    def fold(self) -> None:
        """Fold this step's samples into the state (the planner's share is not touched)."""
        with self._lock:
            samples = StepSamples(pcie_fill=self._pending["pcie_fill"], cpu_expert=self._pending["cpu_expert"])
            self._pending = {"pcie_fill": [], "cpu_expert": []}
        before = self.state.ratio_q16
        if self.on_step is not None:
            self.on_step(samples)
        self.state = next_state(self.state, samples)
        self.history.append((self.state.step, self.state.ratio))
        self.changes += self.state.ratio_q16 != before

    def apply(self, ratio_q16: int) -> None:
        """The share the next plan uses (a device word written only when it changes)."""
        if self.backend.cache.ratio_q16 != ratio_q16:
            self.backend.cache.set_ratio_q16(ratio_q16)

    @property
    def ratio(self) -> float:
        return self.state.ratio

    def status(self) -> dict:
        s = self.state
        return {
            "ratio": s.ratio,
            "target": s.target,
            "steps": s.step,
            "changes": self.changes,
            "pcie_fill_bytes_per_s": s.pcie.estimate,
            "cpu_expert_bytes_per_s": s.cpu.estimate,
            "prior_bytes_per_s": {"pcie_fill": self.prior[0], "cpu_expert": self.prior[1]},
            "params": {f: getattr(s.params, f) for f in s.params.__dataclass_fields__},
            "recent": [[step, r] for step, r in list(self.history)[-32:]],
        }
