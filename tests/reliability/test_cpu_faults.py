"""Fault injection in the CPU expert branch, through the whole engine on CPU: a CPU call that
raises, and a CPU answer that never comes. Each fails its own request quickly with an error that
says what happened; the engine keeps serving and the next request gives the tokens a clean run
gives.

The graph-mode CPU branch runs on CPU too, with a thread playing the GPU's part of the doorbell
(tests/test_doorbell.py): a team stalled in the middle of a step is caught by the watchdog.
"""

from __future__ import annotations

import threading
import time

import anyio
import numpy as np
import pytest

from freetoken.config import EngineConfig, GraphConfig, MoeConfig, SamplingParams
from freetoken.engine.llm import AsyncLLM
from freetoken.errors import EngineError
from freetoken.kernels.cpu import cpu_kernel as kernel_module  # the bf16 CpuKernel calls its cpu_moe
from freetoken.kernels.cpu.doorbell import ABORT, DONE
from freetoken.kernels.cpu.executor import CpuExpertExecutor
from freetoken.kernels.cpu.mailbox import Mailbox
from tests.test_cpu_experts import make_case
from tests.test_doorbell import gpu_side

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [5, 9, 14, 200, 31, 7, 88, 123]
WATCHDOG_S = 1.0
FAIL_WITHIN_S = 2.0


@pytest.fixture(scope="module")
def model_dir(make_checkpoint):
    return make_checkpoint("qwen3_moe", "tiny", seed=28)


def _config(model_dir) -> EngineConfig:
    # Every expert on the CPU: each MoE layer of every step calls the CPU executor.
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=128,
                        moe=MoeConfig(cpu_threads=1, policy="cpu", cache_slots=1),
                        graphs=GraphConfig(watchdog_s=WATCHDOG_S))


async def _run(llm, rid: str):
    """(tokens, error or None, seconds) of one request."""
    started = time.monotonic()
    chunks = [c async for c in llm.generate(PROMPT, GREEDY, rid)]
    errors = [c.error for c in chunks if c.error is not None]
    return [t for c in chunks for t in c.token_ids], (errors[0] if errors else None), time.monotonic() - started


def _serve_with_fault(model_dir, monkeypatch, fault) -> list:
    """A clean request, then one whose first CPU call runs `fault` instead of the kernel, then
    another clean one; their (tokens, error, seconds)."""
    kernel = kernel_module.cpu_moe
    armed = threading.Event()

    def cpu_moe(*args):
        if armed.is_set():
            armed.clear()
            fault()
        return kernel(*args)

    monkeypatch.setattr(kernel_module, "cpu_moe", cpu_moe)

    async def main():
        async with AsyncLLM.start(_config(model_dir)) as llm:
            clean = await _run(llm, "before")
            armed.set()
            faulty = await _run(llm, "faulty")
            after = await _run(llm, "after")
            return [clean, faulty, after]

    return anyio.run(main)


def test_a_cpu_call_that_raises_fails_its_request_and_the_next_one_succeeds(model_dir, monkeypatch):
    def fault():
        raise RuntimeError("injected CPU expert fault")

    (clean, err0, _), (_, error, seconds), (after, err2, _) = _serve_with_fault(model_dir, monkeypatch, fault)
    assert err0 is None and len(clean) == GREEDY.max_tokens
    assert error is not None and "injected CPU expert fault" in error
    assert seconds < FAIL_WITHIN_S
    assert err2 is None and after == clean


def test_a_cpu_answer_that_never_comes_is_caught_by_the_watchdog(model_dir, monkeypatch):
    """The stuck call blocks its worker until the test ends; the watchdog fails the request, a
    fresh worker serves the next one."""
    release = threading.Event()
    try:
        (clean, err0, _), (_, error, seconds), (after, err2, _) = _serve_with_fault(
            model_dir, monkeypatch, lambda: release.wait(60))
    finally:
        release.set()
    assert err0 is None and len(clean) == GREEDY.max_tokens
    assert error is not None and f"no result within {WATCHDOG_S} s" in error
    assert WATCHDOG_S <= seconds < WATCHDOG_S + FAIL_WITHIN_S
    assert err2 is None and after == clean


def test_a_team_stalled_mid_step_is_caught_by_the_watchdog_and_the_next_step_is_served():
    """The device rings layer 0 of three and then nothing (a stalled step): the team's members
    wait for the next ring, the watchdog fails the step within its deadline, every member stops
    on the abort, and the next step on the same mailbox gets every answer right."""
    F, H, I, K = 6, 96, 64, 2
    layers = [(layer, *make_case(F, H, I, 2, K, seed=layer)[:3]) for layer in range(3)]
    _, _, _, w13, w2 = make_case(F, H, I, 2, K)
    mailbox = Mailbox(rows=2, top_k=K, hidden=H, pinned=False)
    with CpuExpertExecutor(w13, w2, threads=2, poller="team") as ex:
        mailbox.compile_poller(ex)
        ticket = ex.serve(mailbox, len(layers), len(layers))
        first: list = []
        gpu_side(mailbox, layers[:1], first)
        started = time.monotonic()
        with pytest.raises(EngineError, match="CPU expert branch failed in a captured decode step"):
            mailbox.finish(ticket, drained=lambda: True, timeout=WATCHDOG_S)
        assert time.monotonic() - started < WATCHDOG_S + FAIL_WITHIN_S
        assert ticket.done() and mailbox.flags[ABORT] == 0 and mailbox.flags[DONE] == 0  # stopped and reset

        ticket = ex.serve(mailbox, len(layers), len(layers))
        results: list = []
        gpu_side(mailbox, layers, results)
        mailbox.finish(ticket, drained=lambda: True, timeout=30)
    for got, (_, x, weights, fids) in zip(first + results, layers[:1] + layers, strict=True):
        want = np.zeros_like(x)
        kernel_module.cpu_moe(x, weights, fids, w13, w2, want)
        np.testing.assert_array_equal(got, want)
