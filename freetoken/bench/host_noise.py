"""What the host took from a timed decode run besides our own work, and how the steps spread.

A hybrid step waits for the CPU's answers, and the CPU team answers a ring only when every
member has done its share: one member descheduled for a few milliseconds (by another thread of
ours, by the guest's other work, or by the hypervisor running another guest on its core) holds
the whole step. Two counters tell those apart:
  - steal: time the machine's CPUs were ready to run but the hypervisor ran something else
    (/proc/stat, all CPUs, in the kernel's clock ticks; 0 on bare metal or where not reported);
  - involuntary context switches of this process's threads (/proc/self/task/*/status): the
    guest's own scheduler took a core from one of our threads.
Per-step wall times show whether a slow run is uniformly slow (every answer slower: memory
bandwidth taken by a neighbour) or slow in a few steps (stalls).
Linux only; elsewhere the counters read as None.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HostCounters:
    steal_ticks: int | None  # summed over every CPU, in USER_HZ ticks
    involuntary_switches: int | None  # summed over this process's threads alive at the reading


def read_counters() -> HostCounters:
    return HostCounters(_steal_ticks(), _involuntary_switches())


def counters_delta(before: HostCounters, after: HostCounters) -> dict:
    """The run's steal (ms, all CPUs together) and involuntary switches; None where unreadable.
    Threads that ended during the run drop out of the second sum, so the switch count can only
    err low."""
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    steal = (None if None in (before.steal_ticks, after.steal_ticks)
             else (after.steal_ticks - before.steal_ticks) * tick_ms)
    switches = (None if None in (before.involuntary_switches, after.involuntary_switches)
                else max(0, after.involuntary_switches - before.involuntary_switches))
    return {"steal_ms": steal, "involuntary_switches": switches}


def step_spread(step_seconds: list[float]) -> dict:
    """Median and slowest step (ms), and how many steps took over twice the median."""
    if not step_seconds:
        raise ValueError("no steps timed")
    ms = sorted(s * 1e3 for s in step_seconds)
    median = ms[(len(ms) - 1) // 2]
    return {"step_ms_median": median, "step_ms_max": ms[-1], "slow_steps": sum(m > 2 * median for m in ms)}


def _steal_ticks() -> int | None:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()  # cpu user nice system idle iowait irq softirq steal ...
    except OSError:
        return None
    return int(fields[8]) if len(fields) > 8 and fields[0] == "cpu" else None


def _involuntary_switches() -> int | None:
    total, seen = 0, False
    for status in Path("/proc/self/task").glob("*/status"):
        try:
            text = status.read_text()
        except OSError:  # the thread ended between listing and reading
            continue
        for line in text.splitlines():
            if line.startswith("nonvoluntary_ctxt_switches:"):
                total += int(line.split()[1])
                seen = True
    return total if seen else None
