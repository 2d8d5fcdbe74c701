"""The mailbox of a captured decode step's CPU branch: the pinned buffers and flag words the GPU
and the CPU poller share (the protocol: kernels/cpu/doorbell.py), and the host's part of it:
arming before a step, waiting for the poller with a watchdog, and poisoning a stuck handshake.

Shape legend: R rows (the largest captured batch), K top-k, H hidden, Q the fills a step may
hand over (every route of every MoE layer, for two steps: what a step leaves queued and the
next step's).
"""

from __future__ import annotations

import time

import numpy as np
from numba import get_num_threads

from freetoken.errors import EngineError
from freetoken.kernels.cpu.copy_engine import (
    COPY_FAILED,
    PACER_WORDS,
    TICKET,
    disabled_plan,
    enter_context,
    flush_fills,
)
from freetoken.kernels.cpu.doorbell import (
    ABORT,
    ACK,
    CHUNK,
    COPY_ERROR,
    DONE,
    FLAG_WORDS,
    HANDOVER,
    LANDED,
    LAYER_SHIFT,
    POISON,
    ROWS_MASK,
    SYNC_WORDS,
    WAIT_ALL,
    serve_rings,
    serve_rings_team,
)


class Mailbox:
    """The shared buffers of one CPU executor's graph-mode branch.

    `host` tensors live in pinned memory on CUDA (the GPU reads and writes them in place);
    the numpy arrays are views of the same bytes for the poller. rows: the largest batch."""

    def __init__(self, rows: int, top_k: int, hidden: int, pinned: bool, layers: int = 1) -> None:
        import torch

        if rows > ROWS_MASK:
            raise ValueError(f"at most {ROWS_MASK} rows, got {rows}")

        def buf(shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=pinned)

        self.rows = rows
        self.flags_t = buf((FLAG_WORDS,), torch.int32)
        self.x_t = buf((rows, hidden), torch.float32)
        self.weights_t = buf((rows, top_k), torch.float32)
        self.fids_t = buf((rows, top_k), torch.int32)
        self.out_t = buf((rows, hidden), torch.float32)
        self.flags = self.flags_t.numpy()
        self.x, self.weights, self.fids, self.out = (t.numpy() for t in (self.x_t, self.weights_t, self.fids_t,
                                                                        self.out_t))
        self.fids[:] = -1
        # The ring's background fills (slot, fid; -1: none), queued on the copy engine by the
        # poller when `fill_plan` has one (kernels/cpu/copy_engine.py); the post kernel writes them.
        self.fills_t = buf((2, rows, top_k), torch.int32)
        self.fill_slots_t, self.fill_fids_t = self.fills_t[0], self.fills_t[1]
        self.fills = self.fills_t.numpy()
        self.fills[:] = -1
        self.fill_plan = disabled_plan()
        # The fills waiting for the copy engine: room for every route of every MoE layer of two
        # steps (a step's leftovers wait for the next step's poller).
        self.pending_fills = np.zeros((2 * max(1, layers) * rows * top_k, 2), np.int32)
        self.pacer = np.zeros(PACER_WORDS, np.int64)
        self.top_k = top_k
        self._team_scratch = None

    def team_scratch(self, intermediate: int) -> tuple[np.ndarray, np.ndarray]:
        """The team poller's activations [rows * K, I] fp32 and sync words (made once)."""
        if self._team_scratch is None or self._team_scratch[0].shape[1] != intermediate:
            self._team_scratch = (np.zeros((self.rows * self.top_k, intermediate), np.float32),
                                  np.zeros(SYNC_WORDS, np.int32))
        return self._team_scratch

    def compile_poller(self, executor) -> None:
        """Compile the executor's poller for these buffers and banks now (a call that answers
        no ring), so the first step does not wait for the compiler."""
        stamps = np.zeros((0, 3), np.int64)
        args = self.poller_args(executor, 0, stamps)
        if executor.poller == "team":
            act, sync = self.team_scratch(executor.kernel.intermediate)
            serve_rings_team(*args, act, sync, get_num_threads())
            sync[:] = 0
        else:
            serve_rings(*args)

    def poller_args(self, executor, last: int, stamps: np.ndarray) -> tuple:
        """The arguments both pollers take, in order (the team poller adds its scratch)."""
        return (self.flags, self.x, self.weights, self.fids, self.out, *executor.kernel.poller_banks(), last,
                stamps, self.fill_plan, self.fills, self.pending_fills, self.pacer)

    def copy_error(self) -> int:
        """The driver's error code where the poller failed to queue a background fill (0: none)."""
        return int(self.flags[COPY_ERROR])

    @staticmethod
    def bell_value(layer: int, rows: int) -> int:
        if not 0 <= layer < (1 << (31 - LAYER_SHIFT)) - 1:
            raise ValueError(f"layer {layer} does not fit a bell value")
        return rows | ((layer + 1) << LAYER_SHIFT)

    def address(self, word: int) -> int:
        """The address of a flag word (host and device address alike under unified addressing)."""
        return self.flags_t.data_ptr() + 4 * word

    def reset(self) -> None:
        """Every flag and count back to zero: the chunk count starts over with the CHUNK word, the
        fill tickets with LANDED (the device's ticket counters must start over with them:
        FillTickets.restart, moe/fill_tickets.py)."""
        self.flags[:] = 0
        self.pacer[:] = 0

    def restart_fill_tickets(self) -> None:
        """Number background fills (LANDED and the poller's count) and their chunks (CHUNK) from
        zero again, the queue emptied; only once the copy stream has landed everything it was
        given (a stream write still to come would undo it)."""
        self.pacer[:] = 0
        self.flags[LANDED] = 0
        self.flags[CHUNK] = 0

    def fill_tickets_issued(self) -> int:
        """How many background fills the poller has numbered since the tickets last started over."""
        return int(self.pacer[TICKET])

    def flush_fills(self) -> None:
        """Queue the fills still waiting for the copy engine at once, from the calling thread (its
        CUDA context current; no poller running): for work outside the graphs, which then waits
        for the copy stream. EngineError if the driver refused one (the queue is emptied)."""
        err = enter_context(self.fill_plan) or flush_fills(self.fill_plan, self.pending_fills, self.pacer)
        if err != 0:
            raise EngineError(COPY_FAILED.format(err))

    def arm(self, handover: bool = False, wait_all: bool = False) -> None:
        """Before a step is launched: no layer of it answered or acknowledged yet; whether its
        post kernels hand background fills over for the copy engine, and whether its start waits
        for every fill numbered so far (graphs that may, read it: FillTickets.await_all).
        (Fills an earlier step left queued stay: this step's poller moves them on.)"""
        self.flags[DONE] = 0
        self.flags[ACK] = 0
        self.flags[COPY_ERROR] = 0
        self.flags[HANDOVER] = int(handover)
        self.flags[WAIT_ALL] = int(wait_all)

    def poison(self, until, timeout: float) -> bool:
        """Stop the poller and keep the done word set until `until()` is true (the stream has
        drained past every wait) or `timeout` seconds pass; True if it drained."""
        self.flags[ABORT] = 1
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.flags[DONE] = POISON  # again each time: a poller finishing its ring may have written its answer
            self.flags[LANDED] = POISON  # and a layer waiting for the ticket of a background fill
            if until():
                return True
            time.sleep(20e-6)
        return False

    def finish(self, ticket, drained, timeout: float) -> None:
        """After a step was queued: wait for the poller's `ticket` (all rings answered). On an
        error or a timeout, poison the done word until `drained()` (the device stream got past
        its last wait), stop the poller, and raise EngineError for this step. A poller that
        does not stop (stuck in a kernel) leaves the abort flag up, so later steps fail fast
        instead of mixing rings."""
        try:
            ticket.wait(timeout)
        except BaseException as exc:
            drained_ok = self.poison(drained, timeout)
            stopped = self.cancel(ticket, timeout)
            state = "the device stream drained" if drained_ok else "the device stream is still blocked"
            if not stopped:
                state += "; the CPU poller did not stop"
            raise EngineError(f"CPU expert branch failed in a captured decode step ({exc}); {state}") from exc

    def cancel(self, ticket, timeout: float) -> bool:
        """Stop a poller whose step will not ring (any more): raise the abort flag, wait for the
        poller to return, reset the flags. True once it has stopped."""
        self.flags[ABORT] = 1
        try:
            ticket.wait(timeout)
        except BaseException:  # an aborted poller fails its ticket: that is the point
            pass
        if not ticket.done():
            return False
        self.reset()
        return True
