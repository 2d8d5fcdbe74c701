"""Where a captured decode step's device time goes, from `bench decode --trace` timelines.

Graph-mode traces carry device timestamps at each MoE layer's phase boundaries
(engine/graph_plane.py, LAYER_PHASES): plan_post (plan, CPU hand-off, bell), fill (slot fill),
gemm (slot GEMM), wait_cpu (the wait for the CPU's answer and the merge), and between_layers
(attention, norms, router). This script sums them per step and per policy, groups the layers by
what they did (fetched experts, CPU routes), and, where the CPU branch ran, matches each layer
with the CPU-side doorbell span of the same ring to split the wait into: the bell reaching the
CPU, the CPU's kernel, and the answer reaching the device. For layers that computed experts on
the CPU and waited for no fetch, it also splits the answer's way to the device by whether a
background fill was likely still streaming in (`--fill-us` per filled expert, from the end of
the layer that handed it over: a rough link model, not a measurement).

  python benchmarks/graph_step_timeline.py hybrid=trace-hybrid.json transfer=trace-transfer.json \\
      --out benchmarks/results/graph-step-timeline-h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

PHASES = ("plan_post", "fill", "gemm", "wait_cpu")


def _track(doc: dict, track: str) -> int | None:
    return next((e["tid"] for e in doc["traceEvents"]
                 if e.get("ph") == "M" and e["name"] == "thread_name" and e["args"]["name"] == track), None)


def _spans(doc: dict, name: str, track: str = "gpu_layers") -> list[dict]:
    """The spans of one name on one track (the host side names some of its own spans alike)."""
    tid = _track(doc, track)
    return sorted((e for e in doc["traceEvents"] if e.get("ph") == "X" and e["name"] == name and e["tid"] == tid),
                  key=lambda e: e["ts"])


def _ns(us: float) -> int:
    """A trace time (us, float) as whole nanoseconds: phase boundaries match exactly there."""
    return round(us * 1000)


def layer_rows(doc: dict) -> list[dict]:
    """One row per (step, MoE layer), in time order: its phase durations (us), fetched experts,
    CPU routes, and the device times (us, trace clock) of its hand-off and of its resumption
    after the wait."""
    rows: list[dict] = []
    for e in _spans(doc, "plan_post"):
        rows.append({"layer": e["args"]["layer"], "fetched": e["args"]["fetched"],
                     "background": e["args"].get("background", 0),
                     "cpu_routes": e["args"]["cpu_routes"], "start": e["ts"], "posted": e["ts"] + e["dur"]})
    rows.sort(key=lambda r: r["start"])
    # Each later phase starts where the previous one ended: find its row by its start.
    ends = {(r["layer"], _ns(r["posted"])): r for r in rows}
    for name in PHASES[1:]:
        for e in _spans(doc, name):
            row = ends.pop((e["args"]["layer"], _ns(e["ts"])), None)
            if row is None:
                continue
            row[name] = e["dur"]
            row["end"] = e["ts"] + e["dur"]
            ends[(row["layer"], _ns(row["end"]))] = row
    starts = {(r["layer"], _ns(r["start"])): r for r in rows}
    for gap in _spans(doc, "between_layers"):
        row = starts.get((gap["args"]["layer"], _ns(gap["ts"] + gap["dur"])))
        if row is not None:
            row["between_layers"] = gap["dur"]
    for r in rows:
        r["plan_post"] = r["posted"] - r["start"]
    return rows


def match_doorbell(rows: list[dict], doc: dict) -> None:
    """Give each layer row that rang the CPU its doorbell span: `bell_to_cpu` (device posted ->
    CPU saw the ring), `cpu` (the CPU's span), `answer_to_device` (CPU answered -> device resumed
    after the wait; includes the merge kernel)."""
    rings = defaultdict(list)
    for e in _spans(doc, "doorbell_cpu_moe", "cpu_executor"):
        rings[e["args"]["layer"]].append(e)
    for row in rows:
        candidates = rings.get(row["layer"], [])
        if not candidates or "end" not in row:
            continue
        ring = min(candidates, key=lambda e: abs(e["ts"] - row["posted"]))
        if abs(ring["ts"] - row["posted"]) > 1000:  # no ring of this layer near this step
            continue
        row["bell_to_cpu"] = ring["ts"] - row["posted"]
        row["cpu"] = ring["dur"]
        row["answer_to_device"] = row["end"] - (ring["ts"] + ring["dur"])


def handoff_by_link(rows: list[dict], fill_us: float) -> dict:
    """answer_to_device of layers that ran experts on the CPU and waited for no fetch (their
    device waited for the answer), split by whether an earlier layer's background fills were
    likely still streaming in when this layer posted (each filled expert taking `fill_us` of
    the link from the end of its layer)."""
    groups: dict[str, list[float]] = {"link_quiet": [], "fill_streaming": []}
    busy_until = float("-inf")
    for row in rows:  # in time order
        waited = row["fetched"] - row.get("background", 0)
        if row["cpu_routes"] > 0 and waited == 0 and "answer_to_device" in row:
            groups["fill_streaming" if row["posted"] < busy_until else "link_quiet"].append(row["answer_to_device"])
        if row.get("background", 0) > 0 and "end" in row:
            busy_until = max(busy_until, row["end"]) + fill_us * row["background"]
    return {k: {"rings": len(v), "median_us": round(statistics.median(v), 2) if v else None}
            for k, v in groups.items()}


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 2) if values else None


def summarise(doc: dict, fill_us: float = 190.0) -> dict:
    rows = layer_rows(doc)
    match_doorbell(rows, doc)
    steps = _spans(doc, "graph_step", "gpu_runner")
    layers = len({r["layer"] for r in rows})  # MoE layers (dense ones take no stamps)
    n_steps = len(rows) // layers if layers else 0
    keys = PHASES + ("between_layers",)

    def per_step_mean(key: str) -> float | None:
        return _mean([sum(r.get(key, 0.0) for r in rows[i * layers:(i + 1) * layers]) for i in range(n_steps)])

    groups = defaultdict(list)
    for r in rows:
        groups[(r["fetched"], r["cpu_routes"])].append(r)
    detail = ("bell_to_cpu", "cpu", "answer_to_device")
    by_work = [{"fetched": f, "cpu_routes": c, "layers": len(g),
                **{k: _mean([r[k] for r in g if k in r]) for k in keys + detail}}
               for (f, c), g in sorted(groups.items())]
    return {
        "steps": n_steps,
        "step_us": _mean([e["dur"] for e in steps]),
        "phase_us_per_step": {k: per_step_mean(k) for k in keys},
        "fetched_per_step": per_step_mean("fetched"),
        "cpu_routes_per_step": per_step_mean("cpu_routes"),
        "by_layer_work_us": by_work,
        "cpu_answer_to_device_us": handoff_by_link(rows, fill_us),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="LABEL=TRACE.json from `bench decode --trace` in graph mode")
    p.add_argument("--out", default=None, help="write the summary JSON here")
    p.add_argument("--fill-us", type=float, default=190.0,
                   help="link time per background-filled expert, for the hand-off split (9.4 MB at ~50 GB/s)")
    args = p.parse_args(argv)
    given = argv if argv is not None else sys.argv[1:]
    out = {"command": "python benchmarks/graph_step_timeline.py " + " ".join(given), "runs": {}}
    for item in args.traces:
        label, _, path = item.partition("=")
        if not path:
            p.error(f"{item!r}: expected LABEL=PATH")
        doc = json.loads(Path(path).read_text())
        summary = summarise(doc, args.fill_us)
        if not summary["steps"]:
            print(f"{label}: {path} has no device layer spans (an eager run, or tracing without device stamps)",
                  file=sys.stderr)
            return 1
        out["runs"][label] = summary
        print(f"{label}: {summary['steps']} steps, {summary['step_us']} us a step, "
              f"per step {summary['phase_us_per_step']}")
        shown = PHASES + ("bell_to_cpu", "cpu", "answer_to_device")
        for g in summary["by_layer_work_us"]:
            print(f"  fetched {g['fetched']} cpu {g['cpu_routes']}: {g['layers']} layers, "
                  + ", ".join(f"{k} {g[k]}" for k in shown if g[k] is not None))
        print(f"  CPU answer to device: {summary['cpu_answer_to_device_us']}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
