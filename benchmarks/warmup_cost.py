"""What the start-up warm-up (freetoken/engine/warmup.py) costs on the CPU, where it compiles nothing.

  - in process: `warm_up` alone on the demo model and on the tests' tiny qwen3_moe (hybrid, 8
    slots), warming decode at batch 1 and at every batch size batch_sizes_for(rows) (what eager
    decode does), alternated on one runner; median of repeats;
  - `serve --model demo --device cpu`: from the process's start to /health answering, with and
    without --no-warmup, alternated.

    python -m benchmarks.warmup_cost --out benchmarks/results/warmup-cost-cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.server_process import ServerProcess, machine


def _warm_up_seconds(model_dir: str, config, repeats: int) -> dict[str, list[float]]:
    """warm_up's seconds on one runner, decode at batch 1 and at every batch size alternated (the
    box's noise falls on both alike)."""
    from freetoken.engine import warmup
    from freetoken.engine.decode_graphs import batch_sizes_for
    from freetoken.engine.model_runner import ModelRunner

    runner = ModelRunner(model_dir, config, config.max_running_requests)
    variants = {"batch 1": [1], "every batch size": batch_sizes_for(runner.rows)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    original = warmup.warm_batch_sizes
    try:
        for _ in range(repeats):
            for name, sizes in variants.items():
                warmup.warm_batch_sizes = lambda r, sizes=sizes: sizes
                times[name].append(warmup.warm_up(runner, config).seconds)
    finally:
        warmup.warm_batch_sizes = original
        runner.close()
    return times


def in_process(repeats: int) -> dict:
    from freetoken.config import EngineConfig, MoeConfig
    from freetoken.engine.llm import resolve_model_dir
    from freetoken.loader.synth import write_synthetic_checkpoint

    demo = EngineConfig(model="demo", device="cpu")
    tiny_dir = write_synthetic_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "qwen3_moe", "tiny", seed=5)
    tiny = EngineConfig(model=str(tiny_dir), device="cpu", dtype="float32", max_model_len=128, max_running_requests=3,
                        moe=MoeConfig(policy="hybrid", cache_slots=8, params={"ratio": 0.5}, cpu_threads=1))
    out = {}
    for name, config, model_dir in (("demo", demo, str(resolve_model_dir(demo))), ("tiny-hybrid", tiny, str(tiny_dir))):
        for variant, times in _warm_up_seconds(model_dir, config, repeats).items():
            out[f"{name}, decode at {variant}"] = {"median_s": statistics.median(times), "runs_s": times}
    return out


def serve_startup(repeats: int) -> dict:
    runs: dict[str, list[float]] = {"warm-up": [], "--no-warmup": []}
    lines = []
    for _ in range(repeats):
        for name, extra in (("warm-up", []), ("--no-warmup", ["--no-warmup"])):
            with tempfile.NamedTemporaryFile(suffix=".log") as log:
                started = time.perf_counter()
                with ServerProcess(["--model", "demo", "--device", "cpu", *extra], log=Path(log.name)):
                    runs[name].append(time.perf_counter() - started)
                lines += [line for line in Path(log.name).read_text().splitlines() if "warm-up" in line]
    return {name: {"median_s": statistics.median(t), "runs_s": t} for name, t in runs.items()} | {
        "warm_up_lines": lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--serve-repeats", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {
        "command": f"python -m benchmarks.warmup_cost --repeats {args.repeats} --serve-repeats {args.serve_repeats} "
                   f"--out {args.out}",
        "machine": machine(),
        "warm_up_in_process": in_process(args.repeats),
        "serve_start_to_health": serve_startup(args.serve_repeats),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
