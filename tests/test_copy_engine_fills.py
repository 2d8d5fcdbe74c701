"""Background fills queued by the CPU poller (kernels/cpu/copy_engine.py), with host functions in
the driver's place: the memcpy copies bytes between host arrays, the stream write stores the
word at once. The compiled pollers, the mailbox's fill lists and the fill tickets in the LANDED
word run as in a captured step; tests/gpu runs the real driver."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from numba import carray, cfunc, types
from numba.extending import intrinsic

from freetoken.errors import EngineError
from freetoken.kernels.cpu.copy_engine import (
    CHUNK_BYTES,
    DEPTH,
    FIRST_BANK,
    HEAD,
    ISSUED,
    TAIL,
    TICKET,
    disabled_plan,
    enqueue_fills,
    flush_fills,
    pump_fills,
)
from freetoken.kernels.cpu.doorbell import ACK, BELL, CHUNK, DONE, LANDED, POISON
from freetoken.kernels.cpu.executor import CpuExpertExecutor
from freetoken.kernels.cpu.mailbox import Mailbox
from tests.test_cpu_experts import make_case


@intrinsic
def _bytes_at(typingctx, addr):
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

    return types.CPointer(types.uint8)(types.int64), codegen


@intrinsic
def _word_at(typingctx, addr):
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

    return types.CPointer(types.int32)(types.int64), codegen


@cfunc(types.int32(types.int64, types.int64, types.int64, types.int64))
def host_memcpy(dst, src, nbytes, stream):
    carray(_bytes_at(dst), (nbytes,))[:] = carray(_bytes_at(src), (nbytes,))
    return 0


@cfunc(types.int32(types.int64, types.int64, types.int64, types.int64))
def failing_memcpy(dst, src, nbytes, stream):
    return 700  # CUDA_ERROR_ILLEGAL_ADDRESS


@cfunc(types.int32(types.int64, types.int64, types.int32, types.int32))
def host_write_value(stream, addr, value, flags):
    carray(_word_at(addr), (1,))[0] = value
    return 0


@cfunc(types.int32(types.int64))
def no_context(ctx):
    return 0


def host_plan(mailbox: Mailbox, host_banks, slot_banks, memcpy=host_memcpy, depth=1) -> np.ndarray:
    fields = []
    for h, s in zip(host_banks, slot_banks, strict=True):
        fields += [h.ctypes.data, s.ctypes.data, h[0].nbytes]
    return np.array([memcpy.address, host_write_value.address, no_context.address, 0, 0,
                     mailbox.address(LANDED), mailbox.address(CHUNK), depth, len(host_banks), *fields], np.int64)


def gpu_side(mailbox: Mailbox, layers, overwrite_after_answer: bool, results: list, slots=None, ack_delay_s=0.0):
    """The captured step's part: per layer, write the CPU work and the fill lists, ring, wait for
    the answer, acknowledge it (ACK); then (as the next layer's post kernel may at once) overwrite
    the fill lists. With `slots`, check that no copy came before the acknowledgement."""
    for layer, x, weights, fids, fill_slots, fill_fids in layers:
        n = x.shape[0]
        mailbox.x[:n], mailbox.weights[:n], mailbox.fids[:n] = x, weights, fids
        mailbox.fills[0, :n], mailbox.fills[1, :n] = fill_slots, fill_fids
        bell = Mailbox.bell_value(layer, n)
        mailbox.flags[BELL] = bell
        deadline = time.monotonic() + 30
        while np.int32(mailbox.flags[DONE] - bell) < 0:
            if time.monotonic() > deadline:
                results.append(TimeoutError(f"layer {layer}: no answer"))
                return
        if ack_delay_s:
            time.sleep(ack_delay_s)
            if slots is not None and any(slots[0][s].any() for s in fill_slots[fill_slots >= 0]):
                results.append(AssertionError(f"layer {layer}: a fill was copied before the answer was read"))
        mailbox.flags[ACK] = bell
        if overwrite_after_answer:
            mailbox.fills[:] = 0  # slot 0 <- fid 0 everywhere, were it read now
        results.append(layer)


def make_step(F, H, I, K, rows, fills_per_layer):
    """Three layers of CPU work, each handing over background fills (slot, fid) of its own."""
    layers, rng = [], np.random.default_rng(7)
    for layer, (n, fills) in enumerate(zip(rows, fills_per_layer, strict=True)):
        x, weights, fids, _, _ = make_case(F, H, I, n, K, seed=layer + 3)
        fill_slots = np.full((n, K), -1, np.int32)
        fill_fids = np.full((n, K), -1, np.int32)
        for (slot, fid), pos in zip(fills, rng.permutation(n * K), strict=False):
            fill_slots.flat[pos], fill_fids.flat[pos] = slot, fid
        layers.append((layer, x, weights, fids, fill_slots, fill_fids))
    return layers


@pytest.mark.parametrize("poller", ["team", "per-call"])
@pytest.mark.parametrize("tickets_before", [0, 2**31 - 2])
def test_poller_queues_each_rings_fills_and_numbers_them(poller, tickets_before):
    """Each ring's fills are copied once the device acknowledged the answer, from the poller's
    copy of the lists (the device rewrites them right after); what the step leaves queued waits
    for the next step's poller, or a flush from the host (as before a prefill); each landed
    fill's ticket goes to LANDED (counting on from earlier steps' fills, across int32
    wrap-around), so in the end it holds the count of fills queued so far."""
    F, H, I, K, S = 12, 64, 32, 4, 8
    _, _, _, w13, w2 = make_case(F, H, I, 1, K)
    host = [np.random.default_rng(1).integers(0, 2**16, (F, 2 * I, H), dtype=np.uint16),
            np.random.default_rng(2).integers(0, 2**16, (F, H, I), dtype=np.uint16)]
    slots = [np.zeros((S,) + h.shape[1:], np.uint16) for h in host]
    fills = [[(3, 5), (6, 11)], [], [(1, 0), (0, 7), (5, 2)]]
    layers = make_step(F, H, I, K, rows=(2, 1, 3), fills_per_layer=fills)
    mailbox = Mailbox(rows=4, top_k=K, hidden=H, pinned=False)
    results: list = []
    with CpuExpertExecutor(w13, w2, threads=2, poller=poller) as ex:
        mailbox.fill_plan = host_plan(mailbox, host, slots)
        mailbox.pacer[TICKET] = tickets_before  # fills of earlier steps: arming keeps their count
        mailbox.arm(handover=True)
        ticket = ex.serve(mailbox, len(layers), len(layers))
        gpu = threading.Thread(target=gpu_side, args=(mailbox, layers, True, results),
                               kwargs={"slots": slots, "ack_delay_s": 0.05})
        gpu.start()
        mailbox.finish(ticket, drained=lambda: True, timeout=30)
        gpu.join(30)
        mailbox.flush_fills()
    assert results == [0, 1, 2]
    filled = {slot: fid for layer in fills for slot, fid in layer}
    for s in range(S):  # the planned slots hold their experts (not the overwritten lists'); no other slot changed
        for h, sb in zip(host, slots, strict=True):
            np.testing.assert_array_equal(sb[s], h[filled[s]] if s in filled else 0, err_msg=f"slot {s}")
    assert mailbox.flags[LANDED] == np.int32(np.int64(tickets_before + 5) & 0xFFFFFFFF)  # (as int32)
    assert mailbox.pacer[TICKET] == tickets_before + 5
    assert mailbox.copy_error() == 0
    mailbox.restart_fill_tickets()
    assert mailbox.flags[LANDED] == 0 and mailbox.pacer[TICKET] == 0


def test_a_failed_copy_fails_the_step():
    """A copy the driver refuses: the step raises (the slot would hold stale bytes) and its
    fill's ticket never lands, so LANDED holds POISON: a device waiting for that ticket before
    its ring goes on instead of hanging until the watchdog. DecodeGraphs then restarts the
    tickets on both sides."""
    F, H, I, K = 6, 32, 16, 2
    _, _, _, w13, w2 = make_case(F, H, I, 1, K)
    host = [np.ones((F, 2 * I, H), np.uint16), np.ones((F, H, I), np.uint16)]
    slots = [np.zeros((4,) + h.shape[1:], np.uint16) for h in host]
    layers = make_step(F, H, I, K, rows=(1, 1), fills_per_layer=[[], []])
    mailbox = Mailbox(rows=1, top_k=K, hidden=H, pinned=False)
    mailbox.fill_plan = host_plan(mailbox, host, slots, memcpy=failing_memcpy)
    left = np.array([[[2, -1]], [[3, -1]]], np.int32)  # an earlier step's fill: slot 2 <- fid 3
    assert enqueue_fills(mailbox.fill_plan, mailbox.pending_fills, mailbox.pacer, left, 1) == 0
    results: list = []

    def device():
        deadline = time.monotonic() + 30
        while mailbox.flags[LANDED] < 1:  # the ticket wait before the first ring
            if time.monotonic() > deadline:
                results.append(TimeoutError("the wait for the failed fill's ticket hung"))
                return
        gpu_side(mailbox, layers, False, results)

    with CpuExpertExecutor(w13, w2, threads=1, poller="team") as ex:
        mailbox.arm(handover=True)
        ticket = ex.serve(mailbox, len(layers), len(layers))
        gpu = threading.Thread(target=device)
        gpu.start()
        with pytest.raises(EngineError, match="CUresult 700"):
            ticket.wait(30)  # (Mailbox.finish would then poison the flags and reset them)
        gpu.join(30)
    assert results == [0, 1]
    assert mailbox.flags[LANDED] == POISON
    assert not slots[0].any()


def test_pacer_moves_one_chunk_at_a_time_then_flushes_the_rest():
    """pump_fills queues one CHUNK_BYTES piece only once the previous one landed (the CHUNK word
    caught up); flush_fills queues what is left at once and empties the queue. Each fill's
    ticket lands behind its last piece."""
    row = 2 * CHUNK_BYTES + 1000  # three pieces a row
    host = [np.random.default_rng(3).integers(0, 256, (5, row), dtype=np.uint8)]
    slots = [np.zeros((4, row), np.uint8)]
    mailbox = Mailbox(rows=1, top_k=2, hidden=8, pinned=False, layers=2)
    plan = host_plan(mailbox, host, slots)
    pending, pacer = mailbox.pending_fills, mailbox.pacer
    fills = np.array([[[2, 0]], [[4, -1]]], np.int32)  # slot 2 <- fid 4; the second entry is no fill
    fills[0, 0, 1] = 3
    fills[1, 0, 1] = 1  # slot 3 <- fid 1
    assert enqueue_fills(plan, pending, pacer, fills, 1) == 0 and pacer[TAIL] == 2
    assert pump_fills(plan, pending, pacer, 0) == 0 and pacer[ISSUED] == 1
    np.testing.assert_array_equal(slots[0][2, :CHUNK_BYTES], host[0][4, :CHUNK_BYTES])
    assert not slots[0][2, CHUNK_BYTES:].any()
    assert pump_fills(plan, pending, pacer, 0) == 0 and pacer[ISSUED] == 1  # chunk 1 not landed: wait
    assert pump_fills(plan, pending, pacer, 1) == 0 and pacer[ISSUED] == 2
    assert not slots[0][2, 2 * CHUNK_BYTES:].any()
    plan[DEPTH] = 2  # two chunks may stream in at once
    assert pump_fills(plan, pending, pacer, 1) == 0 and pacer[ISSUED] == 3  # the row's last piece
    assert pump_fills(plan, pending, pacer, 1) == 0 and pacer[ISSUED] == 3  # 2 and 3 in flight: wait
    np.testing.assert_array_equal(slots[0][2], host[0][4])
    assert mailbox.flags[LANDED] == 1 and pacer[TICKET] == 1  # the first fill is whole
    assert flush_fills(plan, pending, pacer) == 0
    assert mailbox.flags[LANDED] == 2 and pacer[TICKET] == 2
    assert pacer[HEAD] == pacer[TAIL] == 2 and pacer[ISSUED] == 4
    np.testing.assert_array_equal(slots[0][2], host[0][4])
    np.testing.assert_array_equal(slots[0][3], host[0][1])
    assert not slots[0][[0, 1]].any()


def test_no_plan_queues_nothing():
    plan = disabled_plan()
    assert plan.shape == (FIRST_BANK,) and not plan.any()  # MEMCPY 0: the pollers skip every fill step


@pytest.mark.parametrize("poller", ["team", "per-call"])
@pytest.mark.parametrize("handover", [True, False])
def test_next_steps_poller_moves_on_what_a_step_left(poller, handover):
    """Fills a step left queued are pumped by the next step's poller while it waits for its
    first ring, whether or not that step hands fills over: a device layer (or step start)
    waiting for their tickets before it rings is not left waiting for a poller that would only
    pump after a ring."""
    F, H, I, K, S = 8, 32, 16, 2, 6
    _, _, _, w13, w2 = make_case(F, H, I, 1, K)
    host = [np.random.default_rng(4).integers(1, 2**16, (F, 2 * I, H), dtype=np.uint16),
            np.random.default_rng(5).integers(1, 2**16, (F, H, I), dtype=np.uint16)]
    slots = [np.zeros((S,) + h.shape[1:], np.uint16) for h in host]
    mailbox = Mailbox(rows=1, top_k=K, hidden=H, pinned=False)
    mailbox.fill_plan = host_plan(mailbox, host, slots)
    left = np.array([[[4, 1]], [[6, 3]]], np.int32)  # slot 4 <- fid 6, slot 1 <- fid 3
    assert enqueue_fills(mailbox.fill_plan, mailbox.pending_fills, mailbox.pacer, left, 1) == 0
    layers = make_step(F, H, I, K, rows=(1,), fills_per_layer=[[]])
    results: list = []

    def device():
        deadline = time.monotonic() + 30
        while mailbox.flags[LANDED] < 2:  # the layer's ticket wait, before its ring
            if time.monotonic() > deadline:
                results.append(TimeoutError("the leftover fills never landed"))
                return
        gpu_side(mailbox, layers, False, results)

    with CpuExpertExecutor(w13, w2, threads=2, poller=poller) as ex:
        mailbox.arm(handover=handover)
        ticket = ex.serve(mailbox, len(layers), len(layers))
        gpu = threading.Thread(target=device)
        gpu.start()
        mailbox.finish(ticket, drained=lambda: True, timeout=30)
        gpu.join(30)
    assert results == [0]
    for h, sb in zip(host, slots, strict=True):
        np.testing.assert_array_equal(sb[4], h[6])
        np.testing.assert_array_equal(sb[1], h[3])


def test_the_queue_wraps_around():
    """HEAD and TAIL only grow; entries sit at their count modulo the queue's size, so a queue
    that never quite empties keeps going (a full one is flushed to make room)."""
    row = 64
    host = [np.arange(8 * row, dtype=np.uint8).reshape(8, row)]
    slots = [np.zeros((8, row), np.uint8)]
    mailbox = Mailbox(rows=1, top_k=2, hidden=8, pinned=False, layers=1)  # room for 4 fills
    plan, pending, pacer = host_plan(mailbox, host, slots), mailbox.pending_fills, mailbox.pacer
    assert pending.shape[0] == 4

    def ring(*pairs):
        fills = np.full((2, 1, 2), -1, np.int32)
        for k, (slot, fid) in enumerate(pairs):
            fills[:, 0, k] = slot, fid
        assert enqueue_fills(plan, pending, pacer, fills, 1) == 0

    ring((0, 7), (1, 6))
    ring((2, 5))
    for landed in range(3):
        assert pump_fills(plan, pending, pacer, landed) == 0
    assert pacer[HEAD] == pacer[TAIL] == 3 and mailbox.flags[LANDED] == 3
    ring((3, 4), (4, 3))  # entries 3 and 0 (wrapped)
    ring((5, 2), (6, 1))  # 1 and 2: the queue is full (4 waiting), the next flushes first
    ring((7, 0))
    assert pacer[HEAD] == 7 and pacer[TAIL] == 8 and mailbox.flags[LANDED] == 7
    assert flush_fills(plan, pending, pacer) == 0 and mailbox.flags[LANDED] == 8
    np.testing.assert_array_equal(slots[0], host[0][::-1])


@pytest.mark.parametrize("poller", ["team", "per-call"])
def test_a_step_that_hands_over_no_fills_queues_none(poller):
    """A step whose fills stay on its stream (a batch too large for copy-engine fills) writes no
    fill lists; the lists the last step left must not be queued again (that would number fills
    the device never numbered, and overwrite slots given to other experts since)."""
    F, H, I, K, S = 8, 32, 16, 2, 6
    _, _, _, w13, w2 = make_case(F, H, I, 1, K)
    host = [np.ones((F, 2 * I, H), np.uint16), np.ones((F, H, I), np.uint16)]
    slots = [np.zeros((S,) + h.shape[1:], np.uint16) for h in host]
    layers = make_step(F, H, I, K, rows=(1, 1), fills_per_layer=[[(2, 3)], [(4, 5)]])  # stale lists
    mailbox = Mailbox(rows=1, top_k=K, hidden=H, pinned=False)
    results: list = []
    with CpuExpertExecutor(w13, w2, threads=2, poller=poller) as ex:
        mailbox.fill_plan = host_plan(mailbox, host, slots)
        mailbox.arm(handover=False, wait_all=True)
        ticket = ex.serve(mailbox, len(layers), len(layers))
        gpu = threading.Thread(target=gpu_side, args=(mailbox, layers, False, results))
        gpu.start()
        mailbox.finish(ticket, drained=lambda: True, timeout=30)
        gpu.join(30)
        mailbox.flush_fills()
    assert results == [0, 1]
    assert mailbox.fill_tickets_issued() == 0 and mailbox.flags[LANDED] == 0
    assert not slots[0].any() and not slots[1].any()


@pytest.mark.parametrize(("rows", "pending_rows", "expected"), [
    (1, 0, (True, False)),  # nothing landing: the layers' per-slot ticket waits suffice
    (1, 1, (True, False)),  # 2 layers x top-2 x (1 + 1) = 8 routes since the last fills: 10 slots suffice
    (2, 1, (True, True)),  # 12 > 10: a slot still being filled could be a victim, the start waits
    (1, 2, (True, True)),  # the last step's rows count too (deciding on this step's alone missed this)
    (2, 0, (True, False)),
    (4, 0, (False, True)),  # 16 routes > 10: fills stay on the step's stream, none handed over
    (4, 2, (False, True)),
])
def test_copy_fill_schedule(rows, pending_rows, expected):
    from freetoken.moe.copy_engine_fills import copy_fill_schedule

    assert copy_fill_schedule(10, 2, 2, rows, pending_rows) == expected
