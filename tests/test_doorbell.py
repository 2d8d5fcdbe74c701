"""The graph-mode CPU branch's doorbell, with a Python thread playing the GPU's part.

The GPU side of the protocol (stream memory writes and waits) needs CUDA (tests/gpu); here a
thread writes the mailbox and the flag words exactly as the captured step does, so the
compiled poller, the executor's doorbell jobs and the watchdog's poisoning run in CI.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from freetoken.errors import EngineError
from freetoken.kernels.cpu.doorbell import ABORT, BELL, DONE, POISON, CycleClock, cycles_now
from freetoken.kernels.cpu.executor import CpuExpertExecutor
from freetoken.kernels.cpu.experts import cpu_moe
from freetoken.kernels.cpu.mailbox import Mailbox
from tests.test_cpu_experts import TOL, make_case, rel_err, twin


def gpu_side(mailbox: Mailbox, layers: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]], results: list,
             deadline_s: float = 30):
    """What the captured step does per MoE layer: write the work, ring, wait until the done
    word reaches the bell value (it never writes the done word)."""
    mailbox.arm()
    for layer, x, weights, fids in layers:
        n = x.shape[0]
        mailbox.x[:n], mailbox.weights[:n], mailbox.fids[:n] = x, weights, fids
        bell = Mailbox.bell_value(layer, n)
        mailbox.flags[BELL] = bell
        deadline = time.monotonic() + deadline_s
        while np.int32(mailbox.flags[DONE] - bell) < 0:
            if time.monotonic() > deadline:
                results.append(TimeoutError(f"layer {layer}: no answer"))
                return
        results.append(mailbox.out[:n].copy())


def answers_through_poller(w13, w2, layout, poller: str, layers, rows: int, top_k: int, hidden: int) -> list:
    """Each layer's answer from a 2-thread executor's `poller` over banks of any format (`layout`
    None for bf16), with `gpu_side` ringing `layers` [(layer, x, weights, fids)] in turn."""
    mailbox = Mailbox(rows=rows, top_k=top_k, hidden=hidden, pinned=False)
    results: list = []
    with CpuExpertExecutor(w13, w2, threads=2, poller=poller, layout=layout) as ex:
        ticket = ex.serve(mailbox, len(layers), len(layers))
        gpu = threading.Thread(target=gpu_side, args=(mailbox, layers, results))
        gpu.start()
        mailbox.finish(ticket, drained=lambda: True, timeout=60)
        gpu.join(60)
    assert len(results) == len(layers)
    return results


POLLERS = ["team", "per-call"]


@pytest.mark.parametrize("poller", POLLERS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_poller_answers_every_ring_with_the_kernels_result(poller, threads):
    """Every ring's answer equals a direct cpu_moe call bit for bit and the fp32 twin within the
    kernel's tolerance, whichever poller answers and however many threads share the work
    (I = 42 leaves a short last pass; the last ring routes nothing to the CPU)."""
    F, H, I, K = 6, 96, 42, 3
    _, _, _, w13, w2 = make_case(F, H, I, 1, K)
    mailbox = Mailbox(rows=4, top_k=K, hidden=H, pinned=False)
    layers = []
    for layer, n in enumerate((1, 4, 2, 3)):
        x, weights, fids, _, _ = make_case(F, H, I, n, K, seed=layer + 1)
        if layer == 3:
            fids[:] = -1
        layers.append((layer, x, weights, fids))
    results: list = []
    with CpuExpertExecutor(w13, w2, threads=threads, poller=poller) as ex:
        mailbox.compile_poller(ex)  # answers nothing, changes nothing
        assert not mailbox.flags.any()
        ticket = ex.serve(mailbox, len(layers), len(layers))
        gpu = threading.Thread(target=gpu_side, args=(mailbox, layers, results))
        gpu.start()
        mailbox.finish(ticket, drained=lambda: True, timeout=30)
        gpu.join(30)
        stamps = ticket.out
    assert len(results) == 4
    for (_, x, weights, fids), got in zip(layers, results, strict=True):
        want = np.full_like(x, np.nan)
        cpu_moe(x, weights, fids, w13, w2, want)
        np.testing.assert_array_equal(got, want)  # same kernel, same inputs: bit for bit
        assert rel_err(got, twin(x, weights, fids, w13, w2)) <= TOL
    assert stamps[:, 2].tolist() == [1, 2, 3, 4]  # layer + 1 of each ring, in order
    assert (stamps[:, 1] >= stamps[:, 0]).all()
    assert mailbox.flags[BELL] == 0 and mailbox.flags[DONE] == Mailbox.bell_value(3, 3)  # the last answer


def test_team_stays_in_step_through_runs_of_empty_rings():
    """Rings that route nothing to the CPU (most of hybrid's layers) are answered at once. Every
    member must still have read such a ring before the leader publishes the next: before that
    barrier a member that slept through one ring took the next one's value for it, fell out of
    step with the barriers (computing a ring twice and skipping its share of the next), and the
    step hung (seen within 150 steps of this pattern)."""
    F, H, I, K = 8, 64, 32, 2
    _, _, _, w13, w2 = make_case(F, H, I, 1, K)
    mailbox = Mailbox(rows=1, top_k=K, hidden=H, pinned=False)
    rng = np.random.default_rng(0)
    x = np.ones((1, H), np.float32)
    weights = np.full((1, K), 0.5, np.float32)
    with CpuExpertExecutor(w13, w2, threads=2, poller="team") as ex:
        mailbox.compile_poller(ex)
        for step in range(150):
            layers = []
            for layer in range(16):
                fids = rng.integers(0, F, (1, K)).astype(np.int32)
                if rng.random() < 0.6:
                    fids[:] = -1
                layers.append((layer, x, weights, fids))
            results: list = []
            ticket = ex.serve(mailbox, len(layers), len(layers))
            gpu_side(mailbox, layers, results, deadline_s=10)
            mailbox.finish(ticket, drained=lambda: True, timeout=10)
            assert not any(isinstance(r, Exception) for r in results), (step, results)
            for (layer, _, _, fids), got in zip(layers, results, strict=True):  # and every answer is right
                np.testing.assert_array_equal(got, _direct(x, weights, fids, w13, w2), err_msg=f"{step}/{layer}")


@pytest.mark.parametrize("poller", POLLERS)
def test_layers_without_cpu_routes_may_skip_their_ring(poller):
    """The fused hand-off rings only the layers that route to the CPU, and always the step's
    last MoE layer: the poller answers what comes and stops after the last layer's ring."""
    F, H, I, K = 6, 64, 32, 2
    _, _, _, w13, w2 = make_case(F, H, I, 1, K)
    mailbox = Mailbox(rows=2, top_k=K, hidden=H, pinned=False)
    layers = []
    for layer in (1, 4, 5):  # of layers 0..5; 5 is the last MoE layer
        x, weights, fids, _, _ = make_case(F, H, I, 2, K, seed=layer)
        layers.append((layer, x, weights, fids))
    results: list = []
    with CpuExpertExecutor(w13, w2, threads=2, poller=poller) as ex:
        ticket = ex.serve(mailbox, 6, 6)
        gpu = threading.Thread(target=gpu_side, args=(mailbox, layers, results))
        gpu.start()
        mailbox.finish(ticket, drained=lambda: True, timeout=30)
        gpu.join(30)
    assert len(results) == 3 and not any(isinstance(r, Exception) for r in results)
    assert ticket.out[:, 2].tolist() == [2, 5, 6, 0, 0, 0]  # layer + 1 of the rings that came
    for (_, x, weights, fids), got in zip(layers, results, strict=True):
        np.testing.assert_array_equal(got, _direct(x, weights, fids, w13, w2))


@pytest.mark.parametrize("poller", POLLERS)
def test_a_step_nobody_rings_times_out_into_an_error_and_the_executor_lives_on(poller):
    F, H, I, K = 4, 64, 32, 2
    x, weights, fids, w13, w2 = make_case(F, H, I, 2, K)
    mailbox = Mailbox(rows=2, top_k=K, hidden=H, pinned=False)
    with CpuExpertExecutor(w13, w2, threads=2, poller=poller) as ex:
        ticket = ex.serve(mailbox, 2, 2)
        seen_done = []

        def drained():  # the "device" sees the poisoned done word, then drains
            seen_done.append(int(mailbox.flags[DONE]))
            return len(seen_done) > 3

        with pytest.raises(EngineError, match="CPU expert branch failed"):
            mailbox.finish(ticket, drained=drained, timeout=0.3)
        assert seen_done and all(v == POISON for v in seen_done)  # poisoned so any waiting stream passes
        assert mailbox.flags[ABORT] == 0 and mailbox.flags[DONE] == 0  # reset for the next step
        out = np.zeros_like(x)
        np.testing.assert_array_equal(ex.submit(x, weights, fids, out).wait(10), _direct(x, weights, fids, w13, w2))


@pytest.mark.parametrize("poller", POLLERS)
def test_a_kernel_error_inside_the_poller_fails_the_step(poller):
    F, H, I, K = 4, 64, 32, 2
    x, weights, fids, w13, w2 = make_case(F, H, I, 1, K)
    mailbox = Mailbox(rows=1, top_k=K, hidden=H, pinned=False)
    bad = np.full_like(fids, F + 5)  # an expert id past the banks
    with CpuExpertExecutor(w13, w2, threads=2, poller=poller) as ex:
        ticket = ex.serve(mailbox, 1, 1)
        results: list = []
        gpu = threading.Thread(target=gpu_side, args=(mailbox, [(0, x, weights, bad)], results))
        gpu.start()
        with pytest.raises(EngineError, match="expert id out of range"):
            mailbox.finish(ticket, drained=lambda: bool(results), timeout=10)
        gpu.join(10)
    assert len(results) == 1 and not isinstance(results[0], Exception)  # the waiting side was released


@pytest.mark.parametrize("poller", POLLERS)
def test_cancel_stops_an_armed_poller_and_resets_the_flags(poller):
    F, H, I, K = 4, 64, 32, 2
    x, weights, fids, w13, w2 = make_case(F, H, I, 1, K)
    mailbox = Mailbox(rows=1, top_k=K, hidden=H, pinned=False)
    with CpuExpertExecutor(w13, w2, threads=2, poller=poller) as ex:
        ticket = ex.serve(mailbox, 3, 3)  # the step that armed it failed before ringing
        mailbox.cancel(ticket, timeout=10)
        assert ticket.done() and not mailbox.flags.any()
        with pytest.raises(EngineError, match="aborted after 0 rings"):
            ticket.wait(0)
        np.testing.assert_array_equal(ex.submit(x, weights, fids, np.zeros_like(x)).wait(10),
                                      _direct(x, weights, fids, w13, w2))


def test_mailbox_limits_and_clock():
    with pytest.raises(ValueError, match="rows"):
        Mailbox(rows=1 << 16, top_k=2, hidden=8, pinned=False)
    with pytest.raises(ValueError, match="layer"):
        Mailbox.bell_value(1 << 15, 1)
    assert Mailbox.bell_value(0, 4) < Mailbox.bell_value(1, 1)  # values grow with the layer, whatever the rows
    clock = CycleClock()
    c = int(cycles_now())
    time.sleep(0.002)
    now = time.perf_counter_ns()
    assert abs(clock.to_ns(c) - (now - 2_000_000)) < 1_500_000  # within the sleep's jitter
    c0, t0 = int(cycles_now()), time.perf_counter_ns()
    time.sleep(0.01)
    span_cycles, span_ns = int(cycles_now()) - c0, time.perf_counter_ns() - t0
    assert abs(clock.duration_ns(span_cycles) - span_ns) < 0.1 * span_ns  # a span, converted at the measured rate


def _direct(x, weights, fids, w13, w2):
    out = np.zeros_like(x)
    cpu_moe(x, weights, fids, w13, w2, out)
    return out


def test_graph_counters_fold_into_host_stats_once():
    from freetoken.cache.slot_cache import CacheStats
    from freetoken.engine.decode_graphs import batch_sizes_for, key_bucket
    from freetoken.engine.graph_plane import GraphPlane

    plane = GraphPlane(num_layers=2, device="cpu")
    stats = CacheStats.zeros(2)
    plane.count_resident(0, 16)  # a resident layer traced in a forward: counted on the host
    plane.add_resident(plane.resident_routes)  # ... for each time that forward runs
    plane.counts[1, :4] += torch.tensor([3, 2, 1, 1])  # a plan's counts: hits, misses, fetched, background
    plane.fold_into(stats)
    plane.fold_into(stats)  # nothing new: nothing added twice
    assert (stats.hits, stats.misses, stats.fetched, stats.routed) == ([16, 3], [0, 2], [0, 1], [16, 0])
    assert stats.background == [0, 1]
    plane.counts[1, 4] += 5
    plane.fold_into(stats)
    assert stats.cpu_routes == [0, 5]
    assert [key_bucket(n) for n in (1, 128, 129, 4000)] == [128, 128, 256, 4096]
    assert batch_sizes_for(1) == [1] and batch_sizes_for(4) == [1, 2, 4] and batch_sizes_for(6) == [1, 2, 4, 6]


def test_team_members_that_never_run_leave_their_share_to_the_others(monkeypatch):
    """Told a team larger than its threads, the runtime plays several members on one thread in
    turn, so members 1.. of the leader's thread cannot start before the step is over (a member
    descheduled for good). The rings are still answered, by whoever runs, with the same bits."""
    import numba

    F, H, I, K = 6, 96, 64, 2
    layers = [(layer, *make_case(F, H, I, 3, K, seed=layer)[:3]) for layer in range(4)]
    _, _, _, w13, w2 = make_case(F, H, I, 3, K)
    mailbox = Mailbox(rows=3, top_k=K, hidden=H, pinned=False)
    with CpuExpertExecutor(w13, w2, threads=2, poller="team") as ex:
        mailbox.compile_poller(ex)
        monkeypatch.setattr(numba, "get_num_threads", lambda: 7)
        ticket = ex.serve(mailbox, len(layers), len(layers))
        results: list = []
        gpu = threading.Thread(target=gpu_side, args=(mailbox, layers, results))
        gpu.start()
        mailbox.finish(ticket, drained=lambda: True, timeout=30)
        gpu.join(30)
    for (_, x, weights, fids), got in zip(layers, results, strict=True):
        np.testing.assert_array_equal(got, _direct(x, weights, fids, w13, w2))


def test_pollers_compile_on_the_serving_thread_once_per_mailbox():
    """The worker never compiles: compiling there while another thread builds an AST can fail
    on CPython 3.11 before 3.11.8 (see CpuExpertExecutor._compile_kernel)."""
    F, H, I, K = 4, 64, 32, 2
    _, _, _, w13, w2 = make_case(F, H, I, 1, K)
    mailbox = Mailbox(rows=1, top_k=K, hidden=H, pinned=False)
    compiled_on = []
    real = mailbox.compile_poller

    def compile_poller(executor):
        compiled_on.append(threading.current_thread())
        real(executor)

    mailbox.compile_poller = compile_poller
    x, weights = np.ones((1, H), np.float32), np.full((1, K), 0.5, np.float32)
    with CpuExpertExecutor(w13, w2, threads=1) as ex:
        for _ in range(2):
            mailbox.arm()
            ticket = ex.serve(mailbox, 1, 1)
            results: list = []
            gpu_side(mailbox, [(0, x, weights, np.zeros((1, K), np.int32))], results)
            mailbox.finish(ticket, drained=lambda: True, timeout=10)
            assert not any(isinstance(r, Exception) for r in results)
    assert compiled_on == [threading.current_thread()]
