"""The CPU expert branch of a captured decode step: a mailbox in pinned host memory and a
poller in compiled code.

Shape legend: R rows (the largest captured batch), K top-k, H hidden.

Inside a CUDA graph the GPU cannot call Python, so per MoE layer it talks to the CPU through
memory both sides see:
  1. the GPU copies the layer's CPU work into the mailbox (x [R, H] fp32, weights [R, K]
     fp32, fids [R, K] int32 with -1 for routes the GPU computes, packed as `cpu_moe` reads
     them: a split expert's CPU rows above the fid), then writes the bell word
     (stream memory write): rows | ((layer + 1) << 16), growing with the layer;
  2. the poller, spinning on the bell in Numba code that holds no GIL, clears the bell, runs
     `cpu_moe` on the first `rows` rows into `out`, then writes the ring's bell value into the
     done word;
  3. the GPU waits until done >= its bell value (int32 difference; a stream memory wait, or the
     merge kernel's own spin) and adds `out`.
Within a step the bell values grow with the layer, so a done word still holding the previous
layer's answer keeps the next wait blocked; the host clears it (`arm`) before each step. The
GPU never writes the done word, so nothing has to order a device-side clear before the CPU's
next answer (a clear landing after it would block the stream for good). Every value the GPU
writes or waits for is a constant of its layer, as a captured graph needs.

Two pollers answer the same protocol. `serve_rings` (per-call) runs `cpu_moe` for each ring,
which opens its parallel regions anew, and a team idle since the last layer first has to wake.
`serve_rings_team` (the default) keeps the worker's Numba threads assembled for the whole step:
the leader watches the bell and publishes each ring to the others through the team's own sync
words, every member computes its share of the gate/up passes, a spin barrier, its share of the
down pass's rows of H, a second barrier, and the leader answers. Both give the same bits.

A poller serves one step's rings, through the ring of its last MoE layer, and returns, so
nothing spins between steps. With the fused hand-off a layer that routes nothing to the CPU
does not ring at all (the last MoE layer always rings, to end the step). A handshake that does
not finish in time (a kernel error, a poller that never answered) is turned into an error by
`Mailbox.finish` (kernels/cpu/mailbox.py), which poisons the done word until the stream has drained, so a stuck graph
unblocks instead of hanging the engine.

Hybrid's background fills ride along in captured steps (kernels/cpu/copy_engine.py): the post
kernel writes the layer's (slot, fid) pairs into `fills` before ringing, the poller queues them
before answering, and its leader moves them onto the GPU's copy engine a chunk at a time while
it waits for the next ring, once the device has echoed the answer's bell value into ACK; what is
left after the last ring, the next step's poller moves on. The copy stream writes each fill's
ticket to LANDED once it landed, which a later layer touching the slot waits for before it uses it
(or, with rerouting, computes that route on the CPU instead).

Loads and stores of the flag words are atomic acquire/release in the generated code: the
compiler may not hoist the spin out of its loop, and `out` is complete before done is seen.
"""

from __future__ import annotations

import platform
import time

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from freetoken.kernels.cpu import copy_engine, experts
from freetoken.kernels.cpu.copy_engine import (
    HEAD,
    MEMCPY,
    TAIL,
    enqueue_fills,
    enter_context,
    pump_fills,
)
from freetoken.kernels.cpu.experts import (
    DOWN_ROWS,
    GATE_ROWS,
    PREFETCH,
    down_range,
    experts_tuned,
    gate_up_range,
    group_pairs,
    ids_in_range,
)
from freetoken.kernels.cpu.numba_cache import drop_stale_cache
from freetoken.reference import expert_cache

# The pollers below are cached compiled code that includes the copy-engine and expert functions
# (and the split-id constants those compile in).
drop_stale_cache(__file__, [copy_engine.__file__, experts.__file__, expert_cache.__file__])

# int32 word indices of the flags array, 64 bytes apart so each side writes its own cache line.
# For background fills on the copy engine (kernels/cpu/copy_engine.py): ACK, the device's echo of
# a ring's bell value once it has read the answer; LANDED, the ticket of the last fill that landed
# (the copy stream writes it); CHUNK, the number of the last chunk of fills that landed (the copy
# stream writes it too); COPY_ERROR, the driver's error code where queueing them failed;
# HANDOVER, whether this step's post kernels write fills for the poller to queue (host-written:
# a step whose fills stay on its stream leaves the last lists in place); WAIT_ALL, whether this
# step's start waits for every fill numbered so far (host-written; DecodeGraphs decides).
BELL, DONE, ABORT, LANDED, COPY_ERROR, ACK, HANDOVER, CHUNK, WAIT_ALL = 0, 16, 32, 48, 64, 80, 96, 112, 128
FLAG_WORDS = 144
POISON = 0x7FFFFFFF  # a done word at or past every bell value: every wait passes
LAYER_SHIFT = 16  # a bell value: rows in the low 16 bits, layer + 1 above them
ROWS_MASK = (1 << LAYER_SHIFT) - 1


def _int32_words(arr) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == types.int32


def _word_ptr(context, builder, sig, args):
    ary = context.make_array(sig.args[0])(context, builder, args[0])
    return builder.gep(ary.data, [context.cast(builder, args[1], sig.args[1], types.intp)])


@intrinsic
def _load_acquire(typingctx, arr, idx):
    if not _int32_words(arr):
        return None

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_word_ptr(context, builder, sig, args), "acquire", 4)

    return types.int32(arr, idx), codegen


@intrinsic
def _store_release(typingctx, arr, idx, value):
    if not _int32_words(arr):
        return None

    def codegen(context, builder, sig, args):
        val = context.cast(builder, args[2], sig.args[2], types.int32)
        builder.store_atomic(val, _word_ptr(context, builder, sig, args), "release", 4)
        return context.get_dummy_value()

    return types.none(arr, idx, value), codegen


@intrinsic
def _fetch_add(typingctx, arr, idx, value):
    """Atomically add `value` to an int32 word; returns the word's previous value (acq_rel)."""
    if not _int32_words(arr):
        return None

    def codegen(context, builder, sig, args):
        val = context.cast(builder, args[2], sig.args[2], types.int32)
        return builder.atomic_rmw("add", _word_ptr(context, builder, sig, args), val, "acq_rel")

    return types.int32(arr, idx, value), codegen


@intrinsic
def _pause(typingctx):
    """A spin-wait hint (x86 `pause`): eases the spinning core's pressure on its neighbours."""

    def codegen(context, builder, sig, args):
        if platform.machine().lower() in ("x86_64", "amd64"):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def _cycles(typingctx):
    """The CPU's cycle counter (timestamps for the trace; converted with a measured rate)."""

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen


@njit(nogil=True, cache=True)
def cycles_now():
    return _cycles()


@njit(nogil=True)
def _record_copy_error(flags, err):
    """Keep the driver's first error code; from then on LANDED holds POISON (see _pump)."""
    if err != 0:
        if _load_acquire(flags, COPY_ERROR) == 0:
            _store_release(flags, COPY_ERROR, err)
        _store_release(flags, LANDED, POISON)


@njit(nogil=True)
def _hand_over_fills(flags, plan, fills, pending, pacer, rows):
    """Before a ring's answer: queue its background fills (fills [2, R, K]: slots, fids) for the
    copy engine, in steps that hand fills over. Once answered, the device goes on to the next
    layer, whose post kernel rewrites them."""
    if plan[MEMCPY] != 0 and _load_acquire(flags, HANDOVER) != 0 and _load_acquire(flags, COPY_ERROR) == 0:
        _record_copy_error(flags, enqueue_fills(plan, pending, pacer, fills, rows))


@njit(nogil=True)
def _pump(flags, plan, pending, pacer, answered):
    """While waiting for a ring: move the pending fills on by a chunk, once the device has read
    the last answer (`answered`, its bell value; 0: none yet this step): a transfer streaming in
    slows the device's reads of host memory, the hand-off's among them, by tens of microseconds
    on the H200. After a copy error nothing more is queued, and LANDED is held at POISON: the
    device's waits for tickets that will not land pass (the step fails, and the expert cache
    starts empty again), instead of hanging until the watchdog."""
    if _load_acquire(flags, COPY_ERROR) != 0:
        _store_release(flags, LANDED, POISON)  # again each time: a queued ticket write may land after
        return
    if plan[MEMCPY] == 0 or pacer[HEAD] == pacer[TAIL]:
        return
    if answered != 0 and _load_acquire(flags, ACK) - answered < 0:
        return
    _record_copy_error(flags, pump_fills(plan, pending, pacer, _load_acquire(flags, CHUNK)))


@njit(nogil=True, cache=True)
def serve_rings(flags, x, weights, fids, out, w13, w2, last, stamps, plan, fills, pending, pacer):
    """Answer the bell's rings up to and including the one of layer field `last` (the step's
    last MoE layer + 1; layers without CPU routes may not ring at all); returns how many were
    answered (the last one's layer is not `last` when aborted).

    stamps [max rings, 3] int64 receives (cycles at the ring, cycles when answered, layer + 1).
    plan (kernels/cpu/copy_engine.py) with fills [2, R, K] int32 (slots, fids; -1: none): the
    background fills each ring hands over, queued (pending [Q, 2], pacer) and moved onto the copy
    engine a chunk at a time while the poller waits for rings (what is left after the last ring
    stays queued for the next step's poller)."""
    _record_copy_error(flags, enter_context(plan))
    answered = 0
    for j in range(stamps.shape[0]):
        while True:
            v = _load_acquire(flags, BELL)
            if v != 0:
                break
            if _load_acquire(flags, ABORT) != 0:
                return j
            _pump(flags, plan, pending, pacer, answered)
        stamps[j, 0] = _cycles()
        _store_release(flags, BELL, 0)
        rows = v & ROWS_MASK
        experts_tuned(x[:rows], weights[:rows], fids[:rows], w13, w2, out[:rows],
                      np.int64(GATE_ROWS), np.int64(DOWN_ROWS), np.int64(PREFETCH))
        stamps[j, 1] = _cycles()
        stamps[j, 2] = v >> LAYER_SHIFT
        _hand_over_fills(flags, plan, fills, pending, pacer, rows)
        _store_release(flags, DONE, v)
        answered = v
        if v >> LAYER_SHIFT == last:
            return j + 1
    return stamps.shape[0]


# int32 word indices of a team's sync array (one cache line each): the ring generation the
# leader has published and its bell value, the barrier's arrivals and generation, and the
# flags for a team that did not assemble and for ids out of range.
GEN, JOB, ARRIVE, BARGEN, FAIL, BAD_IDS = 0, 16, 32, 48, 64, 80
SYNC_WORDS = 96
# How long (cycles) the team waits to assemble before giving up: ~0.1 s at 2-3 GHz. A team
# that cannot assemble (the runtime ran two members on one thread) fails fast instead of
# deadlocking, and the step runs on the per-call poller.
ASSEMBLE_CYCLES = 300_000_000


@njit(nogil=True)
def _barrier(sync, team, flags, limit):
    """Wait until all `team` members arrived; False on abort, on a failed team, or after
    `limit` cycles (0: no limit), which marks the team failed."""
    gen = _load_acquire(sync, BARGEN)
    if _fetch_add(sync, ARRIVE, 1) == team - 1:
        _store_release(sync, ARRIVE, 0)  # before the release: nobody arrives again until then
        _store_release(sync, BARGEN, gen + 1)
        return True
    start = _cycles()
    while _load_acquire(sync, BARGEN) == gen:
        if _load_acquire(flags, ABORT) != 0 or _load_acquire(sync, FAIL) != 0:
            return False
        if limit > 0 and _cycles() - start > limit:
            _store_release(sync, FAIL, 1)
            return False
        _pause()
    return True


@njit(nogil=True)
def _team_member(t, team, flags, x, weights, fids, out, w13, w2, last, stamps, act, sync, plan, fills, pending, pacer):
    """One member's part of `serve_rings_team`; returns the rings answered (-1: no team)."""
    # A member that arrives after the team was given up (it ran on a thread that played
    # another member first) may complete the count: the failed flag decides.
    if not _barrier(sync, team, flags, ASSEMBLE_CYCLES) or _load_acquire(sync, FAIL) != 0:
        return -1
    H = x.shape[1]
    I = w2.shape[2]
    pf13 = PREFETCH * GATE_ROWS * H
    pf2 = PREFETCH * DOWN_ROWS * I
    units_h = (H + DOWN_ROWS - 1) // DOWN_ROWS  # phase-2 passes
    gen = 0
    answered = 0
    if t == 0:  # the leader queues the background fills, from whichever thread runs it
        _record_copy_error(flags, enter_context(plan))
    for j in range(stamps.shape[0]):
        if t == 0:  # the leader watches the bell and publishes each ring to the team
            while True:
                v = _load_acquire(flags, BELL)
                if v != 0:
                    break
                if _load_acquire(flags, ABORT) != 0:
                    return j
                _pump(flags, plan, pending, pacer, answered)
                _pause()
            stamps[j, 0] = _cycles()
            _store_release(sync, JOB, v)
            _store_release(flags, BELL, 0)
            _store_release(sync, GEN, gen + 1)
        else:
            while _load_acquire(sync, GEN) == gen:
                if _load_acquire(flags, ABORT) != 0:
                    return j
                _pause()
            v = _load_acquire(sync, JOB)
        gen += 1
        rows = v & ROWS_MASK
        if not ids_in_range(fids[:rows], w13.shape[0], I):
            if t == 0:
                _store_release(sync, BAD_IDS, 1)
            return j
        # Every member groups the same few pairs itself: cheaper than another barrier.
        gfids, group_rows, starts, pair_n, pair_w = group_pairs(weights[:rows], fids[:rows], I)
        if gfids.shape[0] > 0:
            # Phase 1: the experts' gate/up passes, split evenly over the team; an expert has
            # one unit per pass over its rows (fewer when split: the GPU runs the rest).
            units_i = (group_rows + GATE_ROWS - 1) // GATE_ROWS
            ends = np.cumsum(units_i)
            k, k1 = t * ends[-1] // team, (t + 1) * ends[-1] // team
            u = 0
            while k < k1:
                while ends[u] <= k:
                    u += 1
                base = ends[u] - units_i[u]
                end = min(k1, ends[u])
                gate_up_range(u, (k - base) * GATE_ROWS, min((end - base) * GATE_ROWS, group_rows[u]),
                              gfids, group_rows, starts, pair_n, x, w13, act, GATE_ROWS, pf13)
                k = end
            if not _barrier(sync, team, flags, 0):
                return j
            # Phase 2: each member owns a range of H and adds every expert into it.
            h0 = min(t * units_h // team * DOWN_ROWS, H)
            h1 = min((t + 1) * units_h // team * DOWN_ROWS, H)
            if h1 > h0:
                down_range(h0, h1, gfids, group_rows, starts, pair_n, pair_w, act, w2, out[:rows], DOWN_ROWS, pf2)
            if not _barrier(sync, team, flags, 0):
                return j
        else:
            # Nothing to compute, but every member must have read this ring before the leader
            # publishes the next: a member that slept through one generation would read the
            # next ring's value as this one's and fall out of step with the barriers (a hang).
            if not _barrier(sync, team, flags, 0):
                return j
            if t == 0:
                out[:rows] = 0.0
        if t == 0:
            stamps[j, 1] = _cycles()
            stamps[j, 2] = v >> LAYER_SHIFT
            _hand_over_fills(flags, plan, fills, pending, pacer, rows)
            _store_release(flags, DONE, v)
            answered = v
        if v >> LAYER_SHIFT == last:  # every member saw the same ring
            return j + 1
    return stamps.shape[0]


@njit(parallel=True, nogil=True, cache=True)
def serve_rings_team(flags, x, weights, fids, out, w13, w2, last, stamps, plan, fills, pending, pacer, act, sync,
                     team):
    """`serve_rings` by a persistent team: the calling thread's Numba threads assemble once per
    step and stay spinning until its last ring, so no ring pays to start (or wake) a parallel
    region; a barrier separates the two phases. Same results, bit for bit, as `serve_rings`.

    act [rows * K, I] fp32 scratch; sync int32 [SYNC_WORDS], zeroed; team: the calling
    thread's Numba thread count (`numba.get_num_threads()`, passed in: reading it inside would
    keep Numba from caching the compiled poller). Returns the rings answered, or -1 when the
    team did not assemble (nothing was answered then)."""
    served = np.zeros(team, np.int64)
    for t in prange(team):
        served[t] = _team_member(t, team, flags, x, weights, fids, out, w13, w2, last, stamps, act, sync, plan,
                                 fills, pending, pacer)
    return served[0]


class CycleClock:
    """Converts `cycles_now()` readings to perf_counter nanoseconds (rate measured on the fly)."""

    def __init__(self) -> None:
        self.c0, self.t0 = int(cycles_now()), time.perf_counter_ns()
        self.rate = None  # cycles per ns

    def to_ns(self, cycles: int) -> int:
        c1, t1 = self._now()
        return int(t1 - (c1 - cycles) / (self.rate or 1.0))

    def duration_ns(self, cycles: int) -> int:
        """A span of `cycles` in nanoseconds."""
        self._now()
        return int(cycles / (self.rate or 1.0))

    def _now(self) -> tuple[int, int]:
        c1, t1 = int(cycles_now()), time.perf_counter_ns()
        if t1 - self.t0 > 1_000_000:  # refine once enough time has passed to measure well
            self.rate = (c1 - self.c0) / (t1 - self.t0)
        return c1, t1
