"""Kernel variants taking turns in captured decode steps, in one process on one host pool: the
shared loop of the A/B scripts (projection_ab.py, slot_gemm_ab.py, norm_fusion_ab.py).

Each (policy, variant) runs `--repeats` times, the variants taking turns within each policy and
the policies within each repeat; the report has every sample and the median run of each, with
`bench decode`'s fields and floor.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from freetoken.bench import decode as bench
from freetoken.cache.host_pool import HostExpertPool
from freetoken.config import ModelConfig
from freetoken.moe.bandwidth_profile import load_ratio, solo_bandwidths


def main(script: str, variants: dict[str, tuple], setter: Callable[..., Callable[[], None]]) -> dict:
    """An A/B script's whole run: `setter(*values)` makes each variant's setter, then the turns."""
    setters = {name: setter(*values) for name, values in variants.items()}
    args, chosen = parse(script, setters)
    return take_turns(script, args, setters, chosen)


def parse(script: str, variants: dict[str, Callable[[], None]]) -> tuple[argparse.Namespace, list[str]]:
    """`bench decode`'s arguments plus --variants (names from `variants`); batch 1 only."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{script}")
    bench.add_bench_decode_arguments(p)
    p.add_argument("--variants", default=",".join(variants))
    args = p.parse_args()
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in variants]
    if unknown or args.batch != 1:
        sys.exit(f"{script}: variants from {', '.join(variants)} (got {unknown}); batch 1 only")
    return args, chosen


def take_turns(script: str, args: argparse.Namespace, variants: dict[str, Callable[[], None]],
               chosen: list[str]) -> dict:
    """Run every (policy, variant) `args.repeats` times, each variant's setter called before its
    run; write and return the report."""
    cfg = ModelConfig.from_dir(args.model)
    pool = HostExpertPool.load(args.model, cfg)
    pool.pin()
    gpu = torch.cuda.get_device_name()
    pair = load_ratio(args.bw_profile, gpu, "bf16")[:2]
    solo = solo_bandwidths(args.bw_profile, gpu, "bf16")
    hbm = bench._device_read_bandwidth("cuda")
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    samples: dict[str, list[dict]] = {f"{pol}/{v}": [] for pol in policies for v in chosen}
    for repeat in range(args.repeats):
        for policy in policies:
            for variant in chosen:
                variants[variant]()
                r = bench._run_policy(args, policy, pool, "cuda", eager=False)
                gc.collect()
                torch.cuda.empty_cache()
                bench.add_floor(r, pair, solo, hbm)
                r["variant"] = variant
                # threads alive in this process after the run (every runner starts its own CPU
                # executor): a count that grows across runs would share the cores between turns
                r["process_threads_after"] = _thread_count()
                samples[f"{policy}/{variant}"].append(r)
                print(f"{policy:9s} {variant:12s} {r['tok_per_s']:8.1f} tok/s  device {r['device_ms_per_step']:.3f} "
                      f"ms  of floor {1 / r['measured_over_floor']:.3f}  threads {r['process_threads_after']}  "
                      f"(repeat {repeat + 1})", file=sys.stderr)
    report = {
        "command": f"python -m benchmarks.{script} " + " ".join(sys.argv[1:]),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"gpu": gpu, "torch": torch.__version__},
        "routing": args.routing_replay or "checkpoint's own router",
        "results": {key: bench.median_run(runs) for key, runs in samples.items()},
    }
    for key, r in report["results"].items():
        print(f"{key:24s} median {r['tok_per_s']:8.1f} tok/s, samples "
              f"{[round(t, 1) for t in r.get('tok_per_s_samples', [r['tok_per_s']])]}", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    pool.unpin()
    return report


def _thread_count() -> int:
    """Threads of this process (Linux: /proc/self/task), -1 where not available."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1
