"""The host-interference counters and step spread that `bench decode` reports."""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time

import pytest

from freetoken.bench.host_noise import HostCounters, counters_delta, read_counters, step_spread


def test_step_spread_finds_the_stalled_steps():
    spread = step_spread([0.002, 0.0021, 0.0019, 0.0102, 0.002])
    assert spread["step_ms_median"] == pytest.approx(2.0)
    assert spread["step_ms_max"] == pytest.approx(10.2)
    assert spread["slow_steps"] == 1  # only the 10.2 ms step took over twice the median
    with pytest.raises(ValueError):
        step_spread([])


def test_counters_delta_converts_ticks_and_keeps_unknowns_unknown():
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    d = counters_delta(HostCounters(100, 7), HostCounters(103, 12))
    assert d == {"steal_ms": pytest.approx(3 * tick_ms), "involuntary_switches": 5}
    assert counters_delta(HostCounters(None, 7), HostCounters(None, 12))["steal_ms"] is None
    # a thread that ended takes its switches out of the second sum: never a negative count
    assert counters_delta(HostCounters(0, 12), HostCounters(0, 7))["involuntary_switches"] == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_read_counters_sees_this_process_preempted():
    before = read_counters()
    assert before.steal_ticks is not None and before.involuntary_switches is not None

    # More runnable threads than CPUs, so the scheduler must take cores from some of them. The
    # threads hash a large buffer: hashlib lets go of the GIL there, so they really run at once
    # (threads spinning in Python bytecode take turns on the GIL and may never be preempted).
    # Counted while they still run: ended threads leave the sum.
    data = os.urandom(1 << 20)
    stop = threading.Event()

    def hash_until_stopped() -> None:
        while not stop.is_set():
            hashlib.sha256(data).digest()

    threads = [threading.Thread(target=hash_until_stopped) for _ in range(2 * (os.cpu_count() or 1) + 2)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 10.0
        during = read_counters()
        while during.involuntary_switches <= before.involuntary_switches and time.monotonic() < deadline:
            time.sleep(0.05)
            during = read_counters()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert during.involuntary_switches > before.involuntary_switches
    assert during.steal_ticks >= before.steal_ticks
