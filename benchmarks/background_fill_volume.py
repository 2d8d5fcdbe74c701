"""What hybrid's plan asks of the link at each split r: a routing trace replayed through the
placement twin (reference/expert_cache.py's `plan_layer`), per decode step, at several r.

    python -m benchmarks.background_fill_volume --trace TRACE.jsonl --slots 768 \
        --expert-bytes 9437184 --ratios 0,0.2,0.25,0.3,0.36,0.41,1 [--steps 512] [--out FILE.json]

Per r: the misses a step has, the fetches its layers wait for (q*'s share), the background fills
(fetched for later steps, computed on the CPU now) and the CPU experts, in experts and bytes a
step, over the trace's steps after the first quarter (the cache warm). Pure arithmetic over the
twin: no GPU, no timing; it says how many bytes each r puts on the link, which the GPU runs time.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from freetoken.reference.expert_cache import CacheState, plan_layer
from freetoken.reference.fetch_rule import FetchRule
from freetoken.trace.routing import RoutingTrace


def replay(trace: RoutingTrace, slots: int, ratio: float, steps: int | None) -> dict:
    state = CacheState(trace.num_layers, trace.num_experts, slots)
    q16 = round(ratio * 65536)
    by_step: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # misses, waited, background, cpu
    for rec in trace:
        if steps is not None and rec.step >= steps:
            break
        plan = plan_layer(state, rec.layer, rec.experts, FetchRule.QSTAR_BACKGROUND, q16)
        later = len(plan.background)
        waited = plan.fetched - later
        row = by_step[rec.step]
        row[0] += plan.misses
        row[1] += waited
        row[2] += later
        row[3] += plan.misses - waited
    kept = sorted(by_step)[len(by_step) // 4:]
    n = max(1, len(kept))
    misses, waited, background, cpu = (sum(by_step[s][i] for s in kept) / n for i in range(4))
    return {"ratio": ratio, "steps": n, "misses": misses, "waited": waited, "background": background,
            "cpu_experts": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--slots", type=int, required=True)
    ap.add_argument("--expert-bytes", type=int, required=True)
    ap.add_argument("--ratios", default="0,0.2,0.25,0.3,0.36,0.41,1")
    ap.add_argument("--steps", type=int, default=None, help="replay only the trace's first steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    trace = RoutingTrace.load(args.trace)
    rows = [replay(trace, args.slots, float(r), args.steps) for r in args.ratios.split(",")]
    mb = args.expert_bytes / 1e6
    print(f"{'r':>6} {'misses':>8} {'waited':>8} {'background':>11} {'cpu':>7} "
          f"{'link MB/step':>13} {'cpu MB/step':>12}")
    for row in rows:
        linked = row["waited"] + row["background"]
        row["link_bytes"] = linked * args.expert_bytes
        row["cpu_bytes"] = row["cpu_experts"] * args.expert_bytes
        print(f"{row['ratio']:6.3f} {row['misses']:8.1f} {row['waited']:8.1f} {row['background']:11.1f} "
              f"{row['cpu_experts']:7.1f} {linked * mb:13.1f} {row['cpu_experts'] * mb:12.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"trace": args.trace, "slots": args.slots, "expert_bytes": args.expert_bytes, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
