"""The CPU expert executor's eager data plane: one persistent worker thread and a doorbell.

`submit` hands (x, weights, ids, out) to the worker and returns a `Ticket` at once; the worker
runs the CPU kernel of the host banks it was built with (kernels/cpu/cpu_kernel.py: bf16, or
GGUF blocks with a type per layer) (the call releases the GIL, so the caller
keeps driving the GPU meanwhile) and rings the ticket. The doorbell is a queue plus one lock
per ticket: a hand-off far cheaper than an asyncio round trip, which the step would wait for.

`serve` hands the worker a captured decode step instead: the worker answers that step's
doorbell rings (kernels/cpu/doorbell.py) in compiled code until the step's last MoE layer,
then takes the next job. poller "team" (the default) keeps the worker's Numba threads in one
parallel region for the whole step; "per-call" starts a parallel region per ring.

Failure never hangs a waiter: a kernel error is raised by `Ticket.wait`, tickets still queued
when the worker stops fail with EngineError, `submit` on a stopped executor raises EngineError,
and `wait(timeout=...)` raises EngineError when no result came in time. A submitted call's plain
`wait()` waits at most the executor's watchdog: past it the call's worker is given up for lost
(a thread cannot be stopped from outside; it exits if its call ever returns), the calls queued
behind it fail, and a fresh worker takes the next ones, so one stuck call fails its own step only.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref

import numba
import numpy as np

from freetoken.errors import EngineError
from freetoken.kernels.cpu.bandwidth import kernel_threads, set_threads
from freetoken.kernels.cpu.cpu_kernel import kernel_for
from freetoken.kernels.cpu.mxfp4_experts import Mxfp4Layout
from freetoken.kernels.cpu.quant_experts import QuantLayout
from freetoken.trace import NULL_RECORDER, TraceRecorder

TRACK = "cpu_executor"
POLLERS = ("team", "per-call")


class Ticket:
    """The result of one submitted call: `wait()` returns `out` once the worker has written it,
    and `compute_ns` is how long the worker's call took (set before the ticket rings)."""

    __slots__ = ("out", "compute_ns", "_bell", "_rung", "_error", "_watchdog")

    def __init__(self, out: np.ndarray, watchdog=None) -> None:
        self.out = out
        self.compute_ns = 0
        self._watchdog = watchdog  # (seconds, called on expiry) for a plain wait(); None: no limit
        self._bell = threading.Lock()
        self._bell.acquire()  # released once, by the worker, when the call has finished
        self._rung = False
        self._error: BaseException | None = None

    def _ring(self, error: BaseException | None = None) -> None:
        self._error = error
        self._bell.release()

    def done(self) -> bool:
        """True once the call has finished (successfully or not); never blocks."""
        if not self._rung and self._bell.acquire(blocking=False):
            self._rung = True
            self._bell.release()
        return self._rung

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """Block until the call finishes; return `out`, or raise the kernel's exception.

        timeout: seconds (None: the executor's watchdog, if the ticket has one, else no limit);
        past it, EngineError (the call may still finish)."""
        if not self._rung:
            expired = None
            if timeout is None and self._watchdog is not None:
                timeout, expired = self._watchdog
            if not self._bell.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
                if expired is not None:
                    expired()
                raise EngineError(f"CPU expert executor gave no result within {timeout} s")
            self._rung = True
            self._bell.release()  # later waits (any thread) pass straight through
        if self._error is not None:
            raise self._error
        return self.out


class CpuExpertExecutor:
    """Runs expert-kernel calls on one worker thread over fixed host banks.

    w13_host uint16 [F, 2I, H] and w2_host uint16 [F, H, I] (bf16 bits, C-contiguous, ideally
    the pinned pool itself), or with `layout` GGUF-block banks: w13_host, w2_host uint8
    [F, bytes] (kernels/cpu/quant_experts.py; layout: each layer's types, experts per layer,
    hidden, intermediate), or with an `Mxfp4Layout` gpt-oss's MXFP4 banks (kernels/cpu/mxfp4_experts.py,
    run from `submit` and `run_inline` only); threads: Numba threads for the kernel (None: `kernel_threads()`,
    the physical cores but one); poller: how `serve` answers a step's rings (see above);
    watchdog_s: how long a submitted call's `wait()` waits before its worker is replaced
    (None: no limit)."""

    def __init__(
        self,
        w13_host: np.ndarray,
        w2_host: np.ndarray,
        threads: int | None = None,
        recorder: TraceRecorder | None = None,
        name: str = TRACK,
        poller: str = "team",
        watchdog_s: float | None = None,
        layout: QuantLayout | Mxfp4Layout | None = None,
    ) -> None:
        if poller not in POLLERS:
            raise ValueError(f"poller must be one of {POLLERS}, got {poller!r}")
        self.kernel = kernel_for(w13_host, w2_host, layout)
        self.w13 = w13_host
        self.w2 = w2_host
        self.hidden = self.kernel.hidden
        self.threads = kernel_threads() if threads is None else threads
        self.poller = poller
        self.name = name
        self.watchdog_s = watchdog_s
        self.workers_replaced = 0
        self._rec = recorder if recorder is not None else NULL_RECORDER
        self._state = threading.Lock()  # orders submit against the worker's shutdown and replacement
        self._alive = True
        self._compiled_pollers: weakref.WeakSet = weakref.WeakSet()  # mailboxes served before
        self._compile_kernel()
        self._start_worker()

    def _start_worker(self) -> None:
        """A fresh worker with its own queue (callers hold `_state`, or nothing runs yet)."""
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(self._jobs,), name=self.name, daemon=True)
        self._thread.start()

    def _replace_worker(self, jobs: queue.SimpleQueue) -> None:
        """The worker of `jobs` is stuck in a call: fail what waits behind it, leave it a stop
        sentinel, and give later calls a fresh worker (once per stuck worker)."""
        with self._state:
            if jobs is not self._jobs or not self._alive:
                return
            self._start_worker()
            self.workers_replaced += 1
        _fail_queued(jobs, EngineError(f"{self.name}: the worker before this call is stuck (watchdog)"))
        jobs.put(None)

    def _compile_kernel(self) -> None:
        """Compile (or load from Numba's cache) the expert kernel here, before the worker starts:
        the first job then pays no compile, and the compiler's parse of our source does not run
        in the worker while this process builds an AST elsewhere (Triton parses its kernels):
        CPython 3.11 before 3.11.8 keeps the AST constructor's recursion count in shared state,
        and two threads building ASTs at once can fail with "AST constructor recursion depth
        mismatch" (python/cpython#106905)."""
        x = np.zeros((0, self.hidden), np.float32)
        for ids_dtype in (np.int32, np.int64):
            self.kernel.run(x, np.zeros((0, 1), np.float32), np.zeros((0, 1), ids_dtype), x)

    def submit(self, x: np.ndarray, weights: np.ndarray, ids: np.ndarray, out: np.ndarray) -> Ticket:
        """Queue out = the experts of (x, weights, ids) and return at once.

        x fp32 [N, H], weights fp32 [N, K], ids int32/int64 [N, K] (fids; -1 = skip), out fp32
        [N, H]; all C-contiguous, and none of them touched by the caller until the ticket rings."""
        if (x.dtype != np.float32 or weights.dtype != np.float32 or out.dtype != np.float32
                or ids.dtype not in (np.int32, np.int64)):
            raise ValueError(f"dtypes: x, weights, out float32 and ids int32/int64; got x {x.dtype}, "
                             f"weights {weights.dtype}, ids {ids.dtype}, out {out.dtype}")
        if not (x.flags.c_contiguous and weights.flags.c_contiguous and ids.flags.c_contiguous
                and out.flags.c_contiguous):
            raise ValueError("x, weights, ids and out must be C-contiguous")
        with self._state:
            if not self._alive:
                raise EngineError(f"{self.name}: the executor is stopped")
            jobs = self._jobs
            watchdog = None
            if self.watchdog_s is not None:
                watchdog = (self.watchdog_s, lambda: self._replace_worker(jobs))
            ticket = Ticket(out, watchdog)
            jobs.put((ticket, "cpu_moe", self.kernel.run, (x, weights, ids, out)))
        return ticket

    def serve(self, mailbox, last: int, rings: int) -> Ticket:
        """Answer `mailbox`'s rings of one captured decode step on the worker, through the ring
        whose layer field is `last` (its last MoE layer + 1), at most `rings` of them; the
        ticket's result is the stamps array [rings, 3] (see doorbell.serve_rings). The rings'
        background fills go to the copy engine where the mailbox has a fill plan."""
        # Compiled here, not in the worker (see _compile_kernel), and before the step it serves
        # starts: the compiler's time is not spent inside that step's watchdog window.
        if mailbox not in self._compiled_pollers:
            mailbox.compile_poller(self)
            self._compiled_pollers.add(mailbox)
        stamps = np.zeros((rings, 3), np.int64)
        ticket = Ticket(stamps)
        args = mailbox.poller_args(self, last, stamps)
        run = self._serve_team if self.poller == "team" else self._serve_per_call
        with self._state:
            if not self._alive:
                raise EngineError(f"{self.name}: the executor is stopped")
            self._jobs.put((ticket, "doorbell", run, (mailbox, args)))
        return ticket

    def _serve_per_call(self, mailbox, args) -> None:
        from freetoken.kernels.cpu.doorbell import serve_rings

        self._check_served(mailbox, serve_rings(*args), args[8], args[9])

    def _serve_team(self, mailbox, args) -> None:
        from freetoken.kernels.cpu.doorbell import BAD_IDS, serve_rings_team
        from freetoken.kernels.cpu.experts import ID_RANGE_ERROR

        act, sync = mailbox.team_scratch(self.kernel.intermediate)
        sync[:] = 0
        served = serve_rings_team(*args, act, sync, numba.get_num_threads())
        if sync[BAD_IDS]:
            raise ValueError(ID_RANGE_ERROR)
        self._check_served(mailbox, served, args[8], args[9])

    def _check_served(self, mailbox, served: int, last: int, stamps: np.ndarray) -> None:
        if mailbox.copy_error():
            from freetoken.kernels.cpu.copy_engine import COPY_FAILED

            raise EngineError(f"{self.name}: " + COPY_FAILED.format(mailbox.copy_error()))
        if served < 1 or stamps[served - 1, 2] != last:
            raise EngineError(f"{self.name}: the doorbell was aborted after {served} rings, before the step's last")

    def run_inline(self, x: np.ndarray, weights: np.ndarray, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """The same call on the caller's thread, skipping the hand-off to the worker and back
        (the eager path can queue its GPU work first, then compute this while the GPU runs)."""
        set_threads(self.threads)  # per calling thread; the same count every time costs nothing
        span = self._rec.begin(self.name, "cpu_moe_inline", tokens=x.shape[0]) if self._rec.enabled else None
        self.kernel.run(x, weights, ids, out)
        if span is not None:
            self._rec.end(span)
        return out

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued calls, then stop the worker."""
        with self._state:
            if self._alive:
                self._jobs.put(None)
        self._thread.join(timeout)

    def __enter__(self) -> CpuExpertExecutor:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _run(self, jobs: queue.SimpleQueue) -> None:
        try:
            rec = self._rec
            while (job := jobs.get()) is not None:
                ticket, name, fn, args = job
                # Numba's thread count is per calling thread; `threads` may change between calls
                # (moe/live_threads.py), and setting an unchanged count costs nothing
                set_threads(self.threads)
                span = rec.begin(self.name, name) if rec.enabled and name == "cpu_moe" else None
                started, error = time.perf_counter_ns(), None
                try:
                    fn(*args)
                except Exception as exc:
                    error = exc
                ticket.compute_ns = time.perf_counter_ns() - started
                ticket._ring(error)
                if span is not None:
                    rec.end(span)
        finally:
            with self._state:
                if jobs is self._jobs:  # a replaced worker's exit leaves its successor running
                    self._alive = False
            _fail_queued(jobs, EngineError(f"{self.name}: the worker stopped before running this call"))


def _fail_queued(jobs: queue.SimpleQueue, error: EngineError) -> None:
    """Ring every ticket still in `jobs` with `error`: nothing queued may wait forever."""
    while True:
        try:
            job = jobs.get_nowait()
        except queue.Empty:
            return
        if job is not None:
            job[0]._ring(error)
