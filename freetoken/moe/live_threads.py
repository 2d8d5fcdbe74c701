"""The CPU executor's thread count following the cores actually free while it serves: the
engine's side of reference/thread_count.py.

It rides on hybrid's live split (moe/live_split.py, `--moe-param adaptive=true`), which already
collects each decode step's timed CPU expert work: at each step's end the split hands the step's
samples here, their rate (bytes/s, `step_rate`) goes to the twin's `next_threads`, and the count
it returns is what the executor's next calls use (kernels/cpu/executor.py sets it per call on its
worker thread). The ceiling is the executor's count at start (`--cpu-threads`, default the
physical cores but one): the search only gives threads up while other processes hold cores, and
takes them back when they leave. Where the bandwidth profile measured the CPU experts' rate (with
every thread), that rate is the twin's reference: the search starts settled, and probes only once
the served rate falls below it (a quiet machine serving as it measured never runs a probe, each of
which costs, and on a quiet machine, fails).

Only the arithmetic is the twin's; this module adds the status for the status endpoint.
"""

from __future__ import annotations

from freetoken.reference.adaptive_split import StepSamples, step_rate
from freetoken.reference.thread_count import ThreadParams, initial_threads, next_threads


class LiveThreads:
    """`fold` from the step's thread (the live split's `on_step`)."""

    def __init__(self, executor, params: ThreadParams | None = None, reference: float | None = None) -> None:
        """reference: bytes/s, the CPU experts' rate the machine's profile measured (None: not measured)."""
        self.executor = executor
        self.start = executor.threads
        self.state = initial_threads(self.start, params or ThreadParams(max_threads=self.start), reference)

    def fold(self, samples: StepSamples) -> None:
        self.state = next_threads(self.state, step_rate(samples.cpu_expert))
        self.executor.threads = self.state.threads

    def status(self) -> dict:
        s = self.state
        return {"threads": s.threads, "home": s.home, "max": s.params.max_threads, "steps": s.step,
                "probes": s.probes, "moves": s.moves, "settled": s.settled,
                "home_cpu_expert_bytes_per_s": s.home_rate, "reference_cpu_expert_bytes_per_s": s.reference}
