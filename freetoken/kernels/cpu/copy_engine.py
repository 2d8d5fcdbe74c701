"""Background slot fills through the GPU's copy engine, issued by the CPU poller.

A captured decode step decides its background fills on the device (the plan kernel), yet a
copy-engine transfer (DMA) can only be queued from the host with its addresses in hand: a graph
cannot hold a copy whose source the device picks at run time. The fill kernel can (it reads the
pinned host banks in place), but its reads of host memory take the device's memory system from
the MoE GEMM running beside it, at any program count, far more than DMA copies or the CPU expert
kernel do (docs/lab, "Background fills through the copy engine").

So the layer's post kernel hands its background fills (slot, fid) to the CPU with the rest of
its CPU work, in the mailbox (kernels/cpu/doorbell.py). The poller queues them (`enqueue_fills`)
and its leader moves them onto a copy stream of its own (`cuMemcpyHtoDAsync`) in CHUNK_BYTES
pieces while it waits for rings (`pump_fills`): at most DEPTH pieces stream in at once, and none
while the device still has to read an answer (it echoes the bell value into ACK once it has).
A transfer streaming into the device slows its reads of host memory, the hand-off's among
them, and whole experts queued at once would hold each hand-off behind them. What a step
leaves in the queue stays there, paced still: the next step's poller goes on from its start.
(Queueing the rest at once after the last ring made the next step's first layers share the
link with it.) Work outside the graphs queues the rest at once from the host (`flush_fills`).

Fill tickets: every fill gets the next number, in the order the poller queues them (the order
of the rings, which is the layers' order), and once its last byte is queued the copy stream
writes that number to LANDED behind it. The post kernel numbers the same fills on the device
(its own running count) and keeps, per slot, the ticket of the last fill into it; a later
layer waits until LANDED reaches the latest ticket among the slots its plan touches (the slots
its routes read, the fill kernel refills and its own background fills take) before it uses
any (kernels/triton/fill_tickets.py). So the copies overlap the rest of their step, the host's
turn between steps and the next step's layers, a layer whose slots have landed does not wait
for the rest, and nothing reads or refills those slots before they land. (Victims are the
least recently used slots, so while the slots outnumber what two steps can touch a fill's slot
is not even a victim candidate; DecodeGraphs checks that bound per step and below it the step
starts by waiting for every ticket, as a step that hands over no fills does.) A ticket's wait
never waits for a poller that is not running: a layer's ticket wait and the
start wait come before its ring, and every step's poller pumps the queue while it waits for
its first ring (after that, once the device acknowledged each answer: steps that hand over no
fills acknowledge none, and have nothing pending after their start wait). Work outside the
graphs flushes the queue and waits on the host first (`DecodeGraphs.settle_fills`). Steps
whose post kernels write no fills tell the poller so (HANDOVER), lest it queue the last lists
again.

The poller calls the driver through function addresses held in a plan array (`FillPlan.plan`):
the compiled poller stays cacheable (no process-specific constant in its code), and a test can
put host functions in their place. Layout of the int64 plan:
  [MEMCPY, WRITE, SET_CONTEXT] function addresses (0 in MEMCPY: no copy-engine fills),
  [CONTEXT] the CUDA context the poller's thread makes current first, [STREAM] the copy stream,
  [LANDED] the address of the flag word receiving each landed fill's ticket, [CHUNK] that of the word counting
  landed chunks, [DEPTH] how many chunks may stream in at once, [BANKS] bank count, then per
  bank (host base, slot base, row bytes).
"""

from __future__ import annotations

import ctypes

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

MEMCPY, WRITE, SET_CONTEXT, CONTEXT, STREAM, LANDED, CHUNK, DEPTH, BANKS, FIRST_BANK = range(10)
BANK_FIELDS = 3  # host base, slot base, row bytes
# The pacer (int64 [PACER_WORDS]): the queue of fills runs from HEAD to TAIL (counts that only
# grow; entry i at pending[i % Q]); the head's copy has reached bank BANK, byte OFFSET; ISSUED
# chunks were queued (the copy stream numbers each in the CHUNK word once it landed); TICKET
# fills were queued whole (the copy stream writes each one's number to LANDED once it landed).
HEAD, TAIL, BANK, OFFSET, ISSUED, TICKET = range(6)
PACER_WORDS = 8
CHUNK_BYTES = 512 << 10  # a small fraction of an expert: what a hand-off read may wait behind
COPY_FAILED = "a background slot fill could not be queued on the copy engine (CUresult {})"


@intrinsic
def _call_i64x4(typingctx, fn, a, b, c, d):
    """fn(a, b, c, d) for a C function at address `fn` taking four 64-bit words, returning int32
    (cuMemcpyHtoDAsync: device pointer, host pointer, byte count, stream)."""

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.IntType(32), [i64] * 4)
        vals = [context.cast(builder, v, t, types.int64) for v, t in zip(args[1:], sig.args[1:], strict=True)]
        return builder.call(builder.inttoptr(args[0], fnty.as_pointer()), vals)

    return types.int32(types.int64, types.int64, types.int64, types.int64, types.int64), codegen


@intrinsic
def _call_write_value(typingctx, fn, stream, addr, value, flags):
    """fn(stream, addr, value, flags) with the cuStreamWriteValue32 signature, returning int32."""

    def codegen(context, builder, sig, args):
        i64, i32 = ir.IntType(64), ir.IntType(32)
        fnty = ir.FunctionType(i32, [i64, i64, i32, i32])
        vals = [context.cast(builder, args[1], sig.args[1], types.int64),
                context.cast(builder, args[2], sig.args[2], types.int64),
                context.cast(builder, args[3], sig.args[3], types.int32),
                context.cast(builder, args[4], sig.args[4], types.int32)]
        return builder.call(builder.inttoptr(args[0], fnty.as_pointer()), vals)

    return types.int32(types.int64, types.int64, types.int64, types.int64, types.int64), codegen


@intrinsic
def _call_i64(typingctx, fn, a):
    """fn(a) for a C function taking one 64-bit word, returning int32 (cuCtxSetCurrent)."""

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(64)])
        return builder.call(builder.inttoptr(args[0], fnty.as_pointer()),
                            [context.cast(builder, args[1], sig.args[1], types.int64)])

    return types.int32(types.int64, types.int64), codegen


@njit(nogil=True)
def enter_context(plan) -> int:
    """Make the plan's CUDA context current on the calling thread (the poller's leader may be any
    of the team's threads); 0, or the driver's error code."""
    if plan[MEMCPY] == 0:
        return 0
    return _call_i64(plan[SET_CONTEXT], plan[CONTEXT])


@njit(nogil=True)
def enqueue_fills(plan, pending, pacer, fills, rows) -> int:
    """Append a ring's background fills (fills [2, R, K]: slots, fids; -1: none; `rows` rows of
    them) to the queue (pending [Q, 2]). A full queue is flushed first (Q is sized for two steps'
    fills, so only an undersized queue pays that). 0, or the driver's error code."""
    if plan[MEMCPY] == 0:
        return 0
    for n in range(rows):
        for k in range(fills.shape[2]):
            slot, fid = fills[0, n, k], fills[1, n, k]
            if slot < 0 or fid < 0:
                continue
            if pacer[TAIL] - pacer[HEAD] == pending.shape[0]:
                err = flush_fills(plan, pending, pacer)
                if err != 0:
                    return err
            at = pacer[TAIL] % pending.shape[0]
            pending[at, 0], pending[at, 1] = slot, fid
            pacer[TAIL] += 1
    return 0


@njit(nogil=True)
def _queue_chunk(plan, pending, pacer, size_limit) -> int:
    """Queue the next piece (at most size_limit bytes) of the queue's head fill and advance; the
    fill's last piece is followed by the write of its ticket to LANDED."""
    at = pacer[HEAD] % pending.shape[0]
    slot, fid = pending[at, 0], pending[at, 1]
    base = FIRST_BANK + BANK_FIELDS * pacer[BANK]
    row = plan[base + 2]
    offset = pacer[OFFSET]
    size = min(size_limit, row - offset)
    err = _call_i64x4(plan[MEMCPY], plan[base + 1] + np.int64(slot) * row + offset,
                      plan[base] + np.int64(fid) * row + offset, size, plan[STREAM])
    pacer[OFFSET] = offset + size
    if pacer[OFFSET] == row:
        pacer[OFFSET] = 0
        pacer[BANK] += 1
        if pacer[BANK] == plan[BANKS]:
            pacer[BANK] = 0
            pacer[HEAD] += 1
            pacer[TICKET] += 1
            if err == 0:
                err = _call_write_value(plan[WRITE], plan[STREAM], plan[LANDED],
                                        np.int32(pacer[TICKET] & 0xFFFFFFFF), 0)
    return err


@njit(nogil=True)
def _note_chunk(plan, pacer) -> int:
    """Number the chunks queued so far: the copy stream writes the count into the CHUNK word."""
    pacer[ISSUED] += 1
    return _call_write_value(plan[WRITE], plan[STREAM], plan[CHUNK], np.int32(pacer[ISSUED] & 0xFFFFFFFF), 0)


@njit(nogil=True)
def pump_fills(plan, pending, pacer, chunk_seen) -> int:
    """Queue one chunk of the pending fills if fewer than plan[DEPTH] are still streaming in
    (chunk_seen, the CHUNK word, trails the chunks issued by that many): a read of host memory by
    the device (the CPU hand-off) then waits behind at most DEPTH * CHUNK_BYTES. 0, or the
    driver's error code."""
    if plan[MEMCPY] == 0 or pacer[HEAD] == pacer[TAIL]:
        return 0
    if np.int32(np.int32(pacer[ISSUED] & 0xFFFFFFFF) - chunk_seen) >= plan[DEPTH]:
        return 0
    err = _queue_chunk(plan, pending, pacer, CHUNK_BYTES)
    if err == 0:
        err = _note_chunk(plan, pacer)
    return err


@njit(nogil=True)
def flush_fills(plan, pending, pacer) -> int:
    """Queue everything still pending at once (from the host, before work outside the graphs; or
    to make room in a full queue). 0, or the first error code (the queue is emptied either way)."""
    err = 0
    if plan[MEMCPY] != 0 and pacer[HEAD] != pacer[TAIL]:
        while pacer[HEAD] != pacer[TAIL] and err == 0:
            err = _queue_chunk(plan, pending, pacer, np.int64(1) << 62)
        if err == 0:
            err = _note_chunk(plan, pacer)
    pacer[HEAD] = pacer[TAIL]
    pacer[BANK] = pacer[OFFSET] = 0
    return err


def disabled_plan() -> np.ndarray:
    return np.zeros(FIRST_BANK, np.int64)


class FillPlan:
    """The copy-engine plan of a mailbox's background fills: the driver's functions, this
    process's context, a copy stream, and the banks (rebuilt when the slot banks move)."""

    def __init__(self, landed_addr: int, chunk_addr: int, depth: int = 1) -> None:
        if depth < 1:
            raise ValueError(f"copy-engine fills need at least one chunk in flight, got {depth}")
        import torch

        lib = ctypes.CDLL("libcuda.so.1")
        self._fns = [_address(lib, name) for name in ("cuMemcpyHtoDAsync", "cuStreamWriteValue32", "cuCtxSetCurrent")]
        ctx = ctypes.c_void_p()
        get = lib.cuCtxGetCurrent
        get.argtypes, get.restype = [ctypes.POINTER(ctypes.c_void_p)], ctypes.c_int
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # the primary context torch uses is current on this thread now
        if get(ctypes.byref(ctx)) != 0 or not ctx.value:
            raise RuntimeError("no current CUDA context to issue background fills in")
        self.stream = torch.cuda.Stream()
        self._head = [*self._fns, ctx.value, self.stream.cuda_stream, landed_addr, chunk_addr, depth]
        self._banks_key: tuple | None = None
        self.plan = disabled_plan()

    def use_banks(self, host_banks, slot_banks) -> np.ndarray:
        """The plan for these banks (pinned host [L*E, ...] and slot [S, ...] pairs, same rows)."""
        key = tuple((h.data_ptr(), s.data_ptr()) for h, s in zip(host_banks, slot_banks, strict=True))
        if key != self._banks_key:
            fields = []
            for h, s in zip(host_banks, slot_banks, strict=True):
                row = h[0].nbytes
                if s[0].nbytes != row or not (h.is_contiguous() and s.is_contiguous()):
                    raise ValueError("host and slot banks need equal, contiguous rows")
                fields += [h.data_ptr(), s.data_ptr(), row]
            self.plan = np.array([*self._head, len(host_banks), *fields], np.int64)
            self._banks_key = key
        return self.plan


def _address(lib, name: str) -> int:
    fn = getattr(lib, name + "_v2", None) or getattr(lib, name)
    return ctypes.cast(fn, ctypes.c_void_p).value
