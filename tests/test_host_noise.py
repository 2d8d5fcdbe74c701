"""The host-interference counters and step spread that `bench decode` reports."""

from __future__ import annotations

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

    # more spinning threads than CPUs: the scheduler must take cores from some of them
    stop = time.perf_counter() + 0.3

    def spin() -> None:
        while time.perf_counter() < stop:
            pass

    threads = [threading.Thread(target=spin) for _ in range(2 * (os.cpu_count() or 1) + 2)]
    for t in threads:
        t.start()
    time.sleep(0.15)  # counted while they still run: ended threads leave the sum
    during = read_counters()
    for t in threads:
        t.join()
    assert during.involuntary_switches > before.involuntary_switches
    assert during.steal_ticks >= before.steal_ticks
