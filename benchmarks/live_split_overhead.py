"""Where the live split's quiet gap goes: hybrid with the profile's split against the live split
with its parts switched off one at a time, each in turn in one process over one pinned pool,
repeated in alternating order so drift falls on every variant alike (issue 34).

Variants (lab switches on a built runner, not engine options):
  static       hybrid, the profile's r throughout (adaptive=false)
  live         hybrid adaptive=true as served: r and the CPU thread count follow the step timings
  live-threads-fixed   adaptive=true, the thread count left at its start (LiveThreads not fed)
  live-measure-only    adaptive=true, samples taken and folded (stamps, per-step syncs, the twin)
                       but neither r nor the threads applied: the cost of measuring alone

Per variant and repeat: per-step wall times (the engine's decode call through the greedy token on
the host), their median, mean and 90th percentile, r at the end, the thread search's status.

    python -m benchmarks.live_split_overhead --model DIR --routing-replay TRACE --moe-cache-slots 768 \\
        --bw-profile PROFILE --steps 160 --repeats 2 --out result.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.cpu_interference import LOADS, interference

VARIANTS = ("static", "live", "live-threads-fixed", "live-measure-only")


def _runner(args: argparse.Namespace, variant: str, pool):
    import torch

    from freetoken.config import EngineConfig, MoeConfig, TraceConfig
    from freetoken.engine.model_runner import ModelRunner

    adaptive = "false" if variant == "static" else "true"
    config = EngineConfig(model=args.model, device="cuda" if torch.cuda.is_available() else "cpu",
                          max_model_len=args.prompt_tokens + args.warmup_tokens + args.steps + 1,
                          moe=MoeConfig(policy="hybrid", params={"adaptive": adaptive},
                                        cache_slots=args.moe_cache_slots, bw_profile=args.bw_profile),
                          trace=TraceConfig(routing_replay=args.routing_replay))
    runner = ModelRunner(args.model, config, rows=1, pool=pool)
    split = runner.live_split
    if variant in ("live", "live-threads-fixed", "live-measure-only") and split is None:
        raise RuntimeError(f"{variant}: the runner has no live split (no bandwidth profile, or no CPU branch)")
    if variant in ("live-threads-fixed", "live-measure-only"):
        split.on_step = None  # the thread count stays at its start
    if variant == "live-measure-only":
        split.apply = lambda ratio_q16: None  # the planner keeps the profile's share
    return runner


def _measure(args: argparse.Namespace, variant: str, pool, load: str) -> dict:
    import torch

    from freetoken.bench.decode import GreedyRows

    runner = _runner(args, variant, pool)
    try:
        rows = GreedyRows(runner, 1, args.prompt_tokens)
        busy, copy = LOADS[load]
        with interference(busy, copy, "pinned"):
            for _ in range(args.warmup_tokens):
                rows.step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                rows.step()
                times.append(time.perf_counter() - t0)
        ms = sorted(t * 1e3 for t in times)
        record = {"variant": variant, "load": load, "steps": len(ms), "mode": "graph" if runner.graphs else "eager",
                  "median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
                  "p90_ms": ms[int(0.9 * (len(ms) - 1))], "tok_per_s": len(ms) / sum(times),
                  "step_ms": [round(t * 1e3, 3) for t in times]}
        if runner.live_split is not None:
            status = runner.live_split.status()
            record["split"] = {k: status[k] for k in ("ratio", "pcie_fill_bytes_per_s", "cpu_expert_bytes_per_s")}
            record["planner_ratio_q16"] = runner.live_split.backend.cache.ratio_q16
        if runner.live_threads is not None:
            record["cpu_threads"] = runner.live_threads.status()
        return record
    finally:
        runner.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--routing-replay", default=None)
    p.add_argument("--moe-cache-slots", type=int, default=None)
    p.add_argument("--bw-profile", required=True)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--warmup-tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=160, help="timed steps per variant and repeat")
    p.add_argument("--repeats", type=int, default=2, help="rounds over the variants, the order reversed each round")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--loads", default="quiet", help=f"of: {', '.join(LOADS)}")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import gc

    import torch

    from freetoken.cache.host_pool import HostExpertPool
    from freetoken.config import ModelConfig

    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    pool = HostExpertPool.load(args.model, ModelConfig.from_dir(args.model))
    pool.pin()
    records = []
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    for load in args.loads.split(","):
        for repeat in range(args.repeats):
            for variant in variants if repeat % 2 == 0 else variants[::-1]:
                record = {"repeat": repeat, **_measure(args, variant, pool, load)}
                records.append(record)
                print(json.dumps({k: v for k, v in record.items() if k != "step_ms"}), file=sys.stderr, flush=True)
                _write(args.out, commit, records)  # after every record: a run cut short keeps what it measured
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    print(json.dumps(_write(args.out, commit, records), indent=1))
    return 0


def _write(out: str, commit: str, records: list[dict]) -> dict:
    """The report of the records so far, written to `out`; its summary returned: each (load,
    variant)'s median and mean step over every repeat, and tok/s by repeat."""
    summary = {}
    for load, variant in dict.fromkeys((r["load"], r["variant"]) for r in records):
        mine = [r for r in records if (r["load"], r["variant"]) == (load, variant)]
        summary[f"{load}/{variant}"] = {"median_ms": statistics.median(t for r in mine for t in r["step_ms"]),
                        "mean_ms": statistics.fmean(t for r in mine for t in r["step_ms"]),
                        "tok_per_s_by_repeat": [round(r["tok_per_s"], 2) for r in mine]}
    report = {"command": " ".join(["python -m benchmarks.live_split_overhead", *sys.argv[1:]]), "commit": commit,
              "summary": summary, "records": records}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    sys.exit(main())
