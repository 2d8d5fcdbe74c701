"""Where a decode step's time goes, per policy: torch profiler tables over a few steps.

    python -m benchmarks.profile_decode --model DIR --moe-cache-slots N --out DIR

Writes <policy>-profile.txt (operators by self CPU time and by device time) for each policy.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from freetoken.cache.host_pool import HostExpertPool
from freetoken.config import EngineConfig, GraphConfig, KernelConfig, ModelConfig, MoeConfig
from freetoken.engine.model_runner import ModelRunner


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--moe-cache-slots", type=int, required=True)
    p.add_argument("--policies", default="resident,hybrid")
    p.add_argument("--moe-ratio", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--eager", action="store_true", help="profile eager steps (default: CUDA graph replays)")
    p.add_argument("--no-pdl", action="store_true",
                   help="launch without programmatic dependent launch: each kernel's device time is then its "
                        "own, not also the wait for the kernel before (which PDL's early start adds)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cfg = ModelConfig.from_dir(args.model)
    pool = HostExpertPool.load(args.model, cfg)
    pool.pin()
    for policy in args.policies.split(","):
        config = EngineConfig(device="cuda", max_model_len=256,
                              moe=MoeConfig(policy=policy,
                                            params={"ratio": args.moe_ratio} if policy == "hybrid" else {},
                                            cache_slots=None if policy == "resident" else args.moe_cache_slots),
                              graphs=GraphConfig(eager=args.eager), kernels=KernelConfig(pdl=not args.no_pdl))
        runner = ModelRunner(args.model, config, rows=1, pool=pool)
        slot = None if runner.states is None else runner.states.acquire()  # (linear-attention models)
        slots = None if slot is None else [slot]
        last = [int(runner.prefill(runner.row_pages(0), list(range(10, 42)), state_slot=slot).argmax())]
        pos = 32
        for _ in range(16):  # warm up
            last = runner.decode([runner.row_pages(0)], last, [pos], slots).argmax(-1).tolist()
            pos += 1
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                last = runner.decode([runner.row_pages(0)], last, [pos], slots).argmax(-1).tolist()
                pos += 1
        elapsed = (time.perf_counter() - t0) / args.steps
        ka = prof.key_averages()
        kernels = [e for e in ka if e.device_type == torch.autograd.DeviceType.CUDA]
        launches = sum(e.count for e in kernels) / args.steps
        device_ms = sum(e.self_device_time_total for e in kernels) / args.steps / 1e3
        text = (f"{policy}: {elapsed * 1e3:.2f} ms/step under the profiler; {launches:.0f} kernels and copies "
                f"a step, {device_ms:.3f} ms of device time a step\n"
                + ka.table(sort_by="self_device_time_total", row_limit=60, max_name_column_width=90)
                + "\n" + ka.table(sort_by="self_cpu_time_total", row_limit=15))
        Path(args.out, f"{policy}-profile.txt").write_text(text)
        print(text[:6000], flush=True)
        runner.close()
        del runner
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
