"""Host time of a step's KV view (`KVCache.view`), which runs before every step while the
device waits: microseconds per call at decode shapes, optionally against another version of
freetoken/models/kv_cache.py (e.g. an older commit's).

    python -m benchmarks.kv_view_host --out FILE.json [--against OLD_KV_CACHE.py]

(for the older one: git show COMMIT:freetoken/models/kv_cache.py > OLD_KV_CACHE.py)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import time

import torch

from freetoken.models import kv_cache

# (rows, pages per sequence, key bucket): one and four sequences, short and longer contexts
SHAPES = [(1, 3, 128), (1, 20, 512), (4, 3, 128), (4, 40, 1024)]


def _us_per_call(module, rows: int, pages: int, keys: int, calls: int = 1000, rounds: int = 5) -> float:
    cache = module.KVCache(2, rows * pages, 16, 4, 128, torch.bfloat16, "cpu")
    tables = [list(range(r * pages, (r + 1) * pages)) for r in range(rows)]
    positions = [[pages * 16 - 5] for _ in range(rows)]
    for _ in range(200):
        cache.view(tables, positions, keys, padded=True)
    best = float("inf")
    for _ in range(rounds):  # the best round: the least disturbed by anything else on the host
        start = time.perf_counter()
        for _ in range(calls):
            cache.view(tables, positions, keys, padded=True)
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--against", help="another kv_cache.py to time beside the current one")
    args = p.parse_args()
    modules = {"current": kv_cache}
    if args.against:
        spec = importlib.util.spec_from_file_location("kv_cache_against", args.against)
        modules["against"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules["against"])
    rows = []
    for r, pages, keys in SHAPES:
        row = dict(rows=r, pages=pages, keys=keys)
        for name, module in modules.items():
            row[f"{name}_us"] = _us_per_call(module, r, pages, keys)
        rows.append(row)
        print(row, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(args.out, "w") as f:
        json.dump(dict(command="python -m benchmarks.kv_view_host --out FILE.json"
                       + (" --against OLD_KV_CACHE.py" if args.against else ""),
                       commit=commit, machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                       torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
