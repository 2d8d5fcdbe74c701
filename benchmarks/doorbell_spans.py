"""Where a hybrid graph step's time goes, from a `bench decode --trace` timeline: the CPU
branch's doorbell spans (ring to answer, per MoE layer) against the graph-step spans.

    python -m benchmarks.doorbell_spans TRACE.json
"""

from __future__ import annotations

import collections
import json
import statistics
import sys


def main() -> None:
    events = json.load(open(sys.argv[1]))["traceEvents"]
    spans = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            spans[e["name"]].append(e)
    rings = sorted(spans["doorbell_cpu_moe"], key=lambda e: e["ts"])
    steps = sorted(spans["graph_step"], key=lambda e: e["ts"])
    durations = [e["dur"] for e in rings]
    print(f"{len(rings)} doorbell spans in {len(steps)} graph steps")
    print(f"doorbell span (us): median {statistics.median(durations):.1f}, "
          f"empty (< 25 us) {sum(d < 25 for d in durations)}")
    histogram = collections.Counter(int(d // 25) * 25 for d in durations if d >= 25)
    print("  spans by 25-us bin from 25 us:", dict(sorted(histogram.items())))
    busy = [sum(e["dur"] for e in rings if s["ts"] <= e["ts"] <= s["ts"] + s["dur"]) for s in steps]
    print(f"graph step median {statistics.median(e['dur'] for e in steps):.0f} us, "
          f"CPU branch busy {statistics.median(busy):.0f} us of it (median)")
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(rings, rings[1:], strict=False)]
    gaps = [g for g in gaps if 0 < g < 2000]  # within a step
    print(f"answer to next ring (the GPU's part between two layers): median {statistics.median(gaps):.0f} us")


if __name__ == "__main__":
    main()
