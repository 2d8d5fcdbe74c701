"""Copy/compute overlap of a streamed prefill, from a torch profiler trace (profile_prefill.py).

    python -m benchmarks.prefill_overlap TRACE.json

Prints the wall time covered by host-to-device copies, by kernels, by both, by neither, and
each copy's start and length, so idle gaps between layers' copies show.
"""

from __future__ import annotations

import json
import sys


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def intersect(a, b) -> float:
    total = 0.0
    for s1, e1 in a:
        for s2, e2 in b:
            total += max(0.0, min(e1, e2) - max(s1, s2))
    return total


def main() -> None:
    events = json.load(open(sys.argv[1]))["traceEvents"]
    copies, kernels = [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        span = (e["ts"], e["ts"] + e.get("dur", 0))
        if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", ""):
            copies.append(span)
        elif e.get("cat") == "kernel":
            kernels.append(span)
    c, k = union(copies), union(kernels)
    start = min(a for a, _ in c + k)
    end = max(b for _, b in c + k)
    both = intersect(c, k)
    wall = end - start
    print(f"wall {wall / 1e3:.1f} ms: copies {length(c) / 1e3:.1f} ms, kernels {length(k) / 1e3:.1f} ms, "
          f"both {both / 1e3:.1f} ms, neither {(wall - length(c) - length(k) + both) / 1e3:.1f} ms")
    for a, b in sorted(copies):
        if b - a > 1000:  # the bank copies (> 1 ms), not the small index uploads
            print(f"  copy at {(a - start) / 1e3:8.1f} ms for {(b - a) / 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
