"""The attention's projections at one row, in captured decode steps: cuBLAS against
`decode_linear` with and without its weight tile loaded before the PDL wait, taking turns in
one process on one host pool (kernels/triton/decode_linear.py).

    python -m benchmarks.projection_ab --model DIR --moe-cache-slots 768 --bw-profile F \
        --policies resident,hybrid [--routing-replay TRACE] --repeats 3 --out F

Takes `bench decode`'s arguments (graph mode only) plus --variants, from:
  cublas      F.linear for q/k/v and the output projection (the router stays on decode_linear)
  triton      decode_linear, weights loaded after the wait
  prefetch    decode_linear, weights loaded before the wait (the engine's default)
  prefetch-4k the same with 4096-element tiles (twice the programs)
Each (policy, variant) runs --repeats times, the variants taking turns; the JSON has every
sample and the median run of each, with `bench decode`'s fields and floor.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from freetoken.bench import decode as bench
from freetoken.bench.bw import load_ratio, solo_bandwidths
from freetoken.cache.host_pool import HostExpertPool
from freetoken.config import ModelConfig
from freetoken.kernels.triton import decode_linear

VARIANTS = {  # name -> (PROJECTION_ROWS, PREFETCH_WEIGHTS, TILE_ELEMENTS)
    "cublas": (0, True, 8192),
    "triton": (1, False, 8192),
    "prefetch": (1, True, 8192),
    "prefetch-4k": (1, True, 4096),
}


def main() -> None:
    p = argparse.ArgumentParser()
    bench.add_bench_decode_arguments(p)
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or args.batch != 1:
        sys.exit(f"projection_ab: variants from {', '.join(VARIANTS)} (got {unknown}); batch 1 only")
    cfg = ModelConfig.from_dir(args.model)
    pool = HostExpertPool.load(args.model, cfg)
    pool.pin()
    gpu = torch.cuda.get_device_name()
    pair = load_ratio(args.bw_profile, gpu, "bf16")[:2]
    solo = solo_bandwidths(args.bw_profile, gpu, "bf16")
    hbm = bench._device_read_bandwidth("cuda")
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    samples: dict[str, list[dict]] = {f"{pol}/{v}": [] for pol in policies for v in variants}
    for repeat in range(args.repeats):
        for policy in policies:
            for variant in variants:
                rows, prefetch, tile = VARIANTS[variant]
                decode_linear.PROJECTION_ROWS, decode_linear.PREFETCH_WEIGHTS = rows, prefetch
                decode_linear.TILE_ELEMENTS = tile
                r = bench._run_policy(args, policy, pool, "cuda", eager=False)
                gc.collect()
                torch.cuda.empty_cache()
                r["floor_ms_per_token"] = bench.floor_ms(r, pair, solo, hbm)
                r["measured_over_floor"] = r["ms_per_token"] / r["floor_ms_per_token"]
                r["variant"] = variant
                samples[f"{policy}/{variant}"].append(r)
                print(f"{policy:9s} {variant:12s} {r['tok_per_s']:8.1f} tok/s  device {r['device_ms_per_step']:.3f} "
                      f"ms  of floor {1 / r['measured_over_floor']:.3f}  (repeat {repeat + 1})", file=sys.stderr)
    report = {
        "command": "python -m benchmarks.projection_ab " + " ".join(sys.argv[1:]),
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


if __name__ == "__main__":
    main()
