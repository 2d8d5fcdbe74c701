"""The CPU expert branch of a captured decode step: a mailbox in pinned host memory and a
poller in compiled code.

Shape legend: R rows (the largest captured batch), K top-k, H hidden.

Inside a CUDA graph the GPU cannot call Python, so per MoE layer it talks to the CPU through
memory both sides see:
  1. the GPU copies the layer's CPU work into the mailbox (x [R, H] fp32, weights [R, K]
     fp32, fids [R, K] int32 with -1 for routes the GPU computes), then writes the bell word
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
`serve_rings_team` (the default) keeps the worker's Numba threads in one parallel region for the
whole step: the leader watches the bell and publishes each ring to the others through the team's
own sync words; every member that is running claims units of work (gate/up blocks, then down
blocks of H) from a shared counter, and the leader answers once all units are finished. No member
is waited for, so one that lost its core to another process only leaves its share to the others.
Every wait spins briefly, then yields its core, then naps (kernels/cpu/backoff.py). Both pollers
give the same bits.

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

import time

import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic

from freetoken.kernels.cpu import (
    backoff,
    block_vectors,
    copy_engine,
    cpu_kernel,
    experts,
    fp4_vectors,
    mxfp4_experts,
    quant_dots,
    quant_experts,
    vector_dots,
)
from freetoken.kernels.cpu.backoff import cycles as _cycles
from freetoken.kernels.cpu.backoff import relax
from freetoken.kernels.cpu.copy_engine import (
    HEAD,
    MEMCPY,
    TAIL,
    enqueue_fills,
    enter_context,
    pump_fills,
)
from freetoken.kernels.cpu.cpu_kernel import ring_down, ring_experts, ring_gate_up
from freetoken.kernels.cpu.experts import BLOCK_H, BLOCK_I, group_pairs, ids_in_range
from freetoken.kernels.cpu.numba_cache import drop_stale_cache
from freetoken.reference import expert_cache

# The pollers below are cached compiled code that includes the copy-engine, expert and wait
# functions (and the constants those compile in).
drop_stale_cache(__file__, [backoff.__file__, block_vectors.__file__, copy_engine.__file__, cpu_kernel.__file__,
                            experts.__file__, fp4_vectors.__file__, mxfp4_experts.__file__, quant_dots.__file__,
                            quant_experts.__file__, vector_dots.__file__, expert_cache.__file__])

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
    slows the device's reads of host memory, the hand-off's among them, and the layer waits for
    the hand-off. After a copy error nothing more is queued, and LANDED is held at POISON: the
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


@njit(nogil=True)
def _await_ring(flags, plan, pending, pacer, answered):
    """The bell value of the next ring once it rang, or 0 when the step was aborted; the pending
    fills move on meanwhile (`answered`: the last answer's bell value, 0 before the first)."""
    since = _cycles()
    while True:
        v = _load_acquire(flags, BELL)
        if v != 0:
            return v
        if _load_acquire(flags, ABORT) != 0:
            return np.int32(0)
        _pump(flags, plan, pending, pacer, answered)
        relax(since)


@njit(nogil=True, cache=True)
def serve_rings(flags, x, weights, fids, out, w13, w2, layout, last, stamps, plan, fills, pending, pacer):
    """Answer the bell's rings up to and including the one of layer field `last` (the step's
    last MoE layer + 1; layers without CPU routes may not ring at all); returns how many were
    answered (the last one's layer is not `last` when aborted).

    w13, w2, layout: the banks and layout of either CPU kernel (kernels/cpu/cpu_kernel.py); Numba
    compiles a poller per bank format.
    stamps [max rings, 3] int64 receives (cycles at the ring, cycles when answered, layer + 1).
    plan (kernels/cpu/copy_engine.py) with fills [2, R, K] int32 (slots, fids; -1: none): the
    background fills each ring hands over, queued (pending [Q, 2], pacer) and moved onto the copy
    engine a chunk at a time while the poller waits for rings (what is left after the last ring
    stays queued for the next step's poller)."""
    _record_copy_error(flags, enter_context(plan))
    answered = 0
    for j in range(stamps.shape[0]):
        v = _await_ring(flags, plan, pending, pacer, answered)
        if v == 0:
            return j
        stamps[j, 0] = _cycles()
        _store_release(flags, BELL, 0)
        rows = v & ROWS_MASK
        ring_experts(x[:rows], weights[:rows], fids[:rows], w13, w2, layout, out[:rows])
        stamps[j, 1] = _cycles()
        stamps[j, 2] = v >> LAYER_SHIFT
        _hand_over_fills(flags, plan, fills, pending, pacer, rows)
        _store_release(flags, DONE, v)
        answered = v
        if v >> LAYER_SHIFT == last:
            return j + 1
    return stamps.shape[0]


# int32 word indices of a team's sync array (one cache line each): the ring generation the
# leader has published and its bell value; the claim word (the ring's tag above CLAIM_BITS, the
# next unit below) and the ring's unit count; the units finished; whether the leader has
# returned; ids out of range.
GEN, JOB, CLAIM, TOTAL, FINISHED, STOP, BAD_IDS = 0, 16, 32, 48, 64, 80, 96
SYNC_WORDS = 112
CLAIM_BITS = 21  # units a ring may have: 2M (a block of 16 rows of an expert's I, or of H)
TAG_MASK = (1 << (31 - CLAIM_BITS)) - 1  # a ring's tag: its generation mod 1024 (a step rings fewer)


@intrinsic
def _compare_exchange(typingctx, arr, idx, expected, value):
    """Set an int32 word to `value` if it holds `expected` (acq_rel); True if it did."""
    if not _int32_words(arr):
        return None

    def codegen(context, builder, sig, args):
        old = context.cast(builder, args[2], sig.args[2], types.int32)
        new = context.cast(builder, args[3], sig.args[3], types.int32)
        res = builder.cmpxchg(_word_ptr(context, builder, sig, args), old, new, "acq_rel", "acquire")
        return builder.extract_value(res, 1)

    return types.boolean(arr, idx, expected, value), codegen


@njit(nogil=True)
def _claim(sync, tag):
    """The next unit of the ring tagged `tag`, or -1 when it has none left or is over. The tag
    in the claim word makes the check and the claim one atomic step: a member that read a ring
    late cannot take a unit of the next one (whose scratch it has not grouped)."""
    while True:
        word = _load_acquire(sync, CLAIM)
        unit = word & ((1 << CLAIM_BITS) - 1)
        if word >> CLAIM_BITS != tag or unit >= _load_acquire(sync, TOTAL):
            return -1
        if _compare_exchange(sync, CLAIM, word, word + 1):
            return unit


@njit(nogil=True)
def _work(sync, flags, tag, first, rows, x, weights, fids, out, w13, w2, layout, act):
    """Compute units of one ring, starting with the claimed `first`, until none are left.

    Units [0, n1): phase 1, one (expert, block of BLOCK_I intermediate indices) each; units
    [n1, n1 + ceil(H / BLOCK_H)): phase 2, one block of BLOCK_H rows of out each, every expert
    added in ascending order. A unit's bits do not depend on who computes it, so any claiming
    order gives `cpu_moe`'s result. A phase-2 unit waits until every phase-1 unit is finished:
    those were all claimed before it, by members that are computing them."""
    H = x.shape[1]
    I = layout[2]
    # A claimed unit keeps the ring open, so the mailbox holds this ring's ids meanwhile.
    gfids, starts, pair_n, pair_w = group_pairs(weights[:rows], fids[:rows])
    blocks = (I + BLOCK_I - 1) // BLOCK_I  # phase-1 units per expert
    n1 = gfids.shape[0] * blocks
    k = first
    while k >= 0:
        if k < n1:
            u, b = divmod(k, blocks)
            i = b * BLOCK_I
            ring_gate_up(u, i, min(i + BLOCK_I, I), gfids, starts, pair_n, x, w13, act, layout)
        else:
            since = _cycles()
            while _load_acquire(sync, FINISHED) < n1:
                if _load_acquire(flags, ABORT) != 0:
                    return
                relax(since)
            h0 = (k - n1) * BLOCK_H
            ring_down(h0, min(h0 + BLOCK_H, H), gfids, starts, pair_n, pair_w, act, w2, out[:rows], layout)
        _fetch_add(sync, FINISHED, 1)
        k = _claim(sync, tag)


@njit(nogil=True)
def _lead(flags, x, weights, fids, out, w13, w2, layout, last, stamps, act, sync, plan, fills, pending, pacer):
    """The leader: watches the bell, publishes each ring to the team, works on it, waits until
    its units are finished and answers. Returns the rings answered."""
    units_i = (layout[2] + BLOCK_I - 1) // BLOCK_I  # phase-1 units per expert
    units_h = (x.shape[1] + BLOCK_H - 1) // BLOCK_H
    answered = 0
    _record_copy_error(flags, enter_context(plan))
    for j in range(stamps.shape[0]):
        v = _await_ring(flags, plan, pending, pacer, answered)
        if v == 0:
            return j
        stamps[j, 0] = _cycles()
        _store_release(flags, BELL, 0)
        rows = v & ROWS_MASK
        if not ids_in_range(fids[:rows], w13.shape[0]):
            _store_release(sync, BAD_IDS, 1)
            return j
        experts_routed = group_pairs(weights[:rows], fids[:rows])[0].shape[0]
        if experts_routed == 0:
            out[:rows] = 0.0
        else:
            total = experts_routed * units_i + units_h
            tag = (j + 1) & TAG_MASK
            # The claim word first: a member still on the last ring then fails its claim before
            # it could read this ring's unit count (see _claim).
            _store_release(sync, FINISHED, 0)
            _store_release(sync, CLAIM, tag << CLAIM_BITS)
            _store_release(sync, TOTAL, total)
            _store_release(sync, JOB, v)
            _store_release(sync, GEN, j + 1)
            _work(sync, flags, tag, _claim(sync, tag), rows, x, weights, fids, out, w13, w2, layout, act)
            since = _cycles()
            while _load_acquire(sync, FINISHED) < total:  # units other members still compute
                if _load_acquire(flags, ABORT) != 0:
                    return j
                relax(since)
        stamps[j, 1] = _cycles()
        stamps[j, 2] = v >> LAYER_SHIFT
        _hand_over_fills(flags, plan, fills, pending, pacer, rows)
        _store_release(flags, DONE, v)
        answered = v
        if v >> LAYER_SHIFT == last:
            return j + 1
    return stamps.shape[0]


@njit(nogil=True)
def _help(flags, x, weights, fids, out, w13, w2, layout, act, sync):
    """A member other than the leader: joins each ring published while it runs, until the leader
    returns. It is never waited for: a member that is descheduled (or never starts, when the
    runtime runs several members on one thread) only leaves its share to the others."""
    seen = 0
    while True:
        since = _cycles()
        while True:
            gen = _load_acquire(sync, GEN)
            if gen != seen:
                break
            if _load_acquire(sync, STOP) != 0 or _load_acquire(flags, ABORT) != 0:
                return
            relax(since)
        seen = gen
        tag = gen & TAG_MASK
        rows = _load_acquire(sync, JOB) & ROWS_MASK
        first = _claim(sync, tag)
        if first >= 0:
            _work(sync, flags, tag, first, rows, x, weights, fids, out, w13, w2, layout, act)


@njit(parallel=True, nogil=True, cache=True)
def serve_rings_team(flags, x, weights, fids, out, w13, w2, layout, last, stamps, plan, fills, pending, pacer, act,
                     sync, team):
    """`serve_rings` by a persistent team: the calling thread's Numba threads stay in one
    parallel region for the whole step, so no ring pays to start (or wake) one. Members claim a
    ring's units from a shared counter instead of owning a fixed share, so the ring finishes as
    soon as its units are done by whoever runs: a member that lost its core to another process
    delays nobody. Same results, bit for bit, as `serve_rings`.

    act [rows * K, I] fp32 scratch; sync int32 [SYNC_WORDS], zeroed; team: the calling
    thread's Numba thread count (`numba.get_num_threads()`, passed in: reading it inside would
    keep Numba from caching the compiled poller). Returns the rings answered."""
    served = np.zeros(team, np.int64)
    for t in prange(team):
        if t == 0:  # a thread runs its members in order, so the leader never waits behind one
            served[t] = _lead(flags, x, weights, fids, out, w13, w2, layout, last, stamps, act, sync, plan, fills,
                              pending, pacer)
            _store_release(sync, STOP, 1)
        else:
            _help(flags, x, weights, fids, out, w13, w2, layout, act, sync)
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
