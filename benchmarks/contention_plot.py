"""Plots of a contention run (`benchmarks/cpu_interference.py --model ...` JSON): decode tok/s per
load and policy as grouped bars, and the live split's share r step by step as the loads change.

    python -m benchmarks.contention_plot RESULT.json          # RESULT-tok-s.png, RESULT-split.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from freetoken.plot import grouped_bar_plot, line_plot


def decode_records(report: dict) -> list[dict]:
    """The measured decode loads (a child that failed or was cut adds a record with no load)."""
    return [r for r in report["records"] if r.get("part") == "decode" and "load" in r]


def tok_per_s_by_load(report: dict) -> dict[str, dict[str, float]]:
    """{load: {policy: tok/s}} in the run's order; a frozen run counts its tokens over its time."""
    groups: dict[str, dict[str, float]] = {}
    for r in decode_records(report):
        groups.setdefault(r["load"], {})[r["policy"]] = r["tok_per_s"]
    return groups


def split_series(report: dict) -> dict[str, list[tuple[float, float] | None]]:
    """Each live split's r per step across the loads, in run order (a break between loads)."""
    series: dict[str, list[tuple[float, float] | None]] = {}
    for r in decode_records(report):
        if r.get("split_trace"):
            points = series.setdefault(r["policy"], [])
            if points:
                points.append(None)
            points += [(float(step), float(share)) for step, share in r["split_trace"]]
    return series


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", help="the JSON a CUDA run of benchmarks.cpu_interference wrote")
    args = p.parse_args(argv)
    path = Path(args.result)
    report = json.loads(path.read_text())
    groups = tok_per_s_by_load(report)
    if not groups:
        print(f"{path}: no decode records (a CPU-part run?)", file=sys.stderr)
        return 2
    stem = path.with_suffix("")
    bars = grouped_bar_plot(f"{stem}-tok-s.png", groups, title="decode tok/s under interference, batch 1",
                            y_label="tokens/s")
    print(bars)
    series = split_series(report)
    if series:
        steps = [pt[0] for points in series.values() for pt in points if pt is not None]
        lines = line_plot(f"{stem}-split.png", series, title="live split: PCIe share r per step, load after load",
                          x_label="decode step", y_label="r", x_range=(min(steps), max(steps)), y_range=(0.0, 1.0))
        print(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
