"""Where a streamed prefill chunk's time goes: the torch profiler over one warm chunk.

    python -m benchmarks.profile_prefill --model DIR --moe-cache-slots N --tokens 8192 --out DIR

Writes prefill-profile.txt (device time by kernel, host time by operator) and
prefill-trace.json (a Perfetto-loadable timeline: compute and copy streams side by side, so
whether layer l+1's copy overlaps layer l's compute can be seen).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from freetoken.config import EngineConfig, MoeConfig, SchedulerConfig
from freetoken.engine.model_runner import ModelRunner


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--moe-cache-slots", type=int, required=True)
    p.add_argument("--moe-policy", default="hybrid")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    config = EngineConfig(device="cuda", max_model_len=2 * args.tokens + 1,
                          moe=MoeConfig(policy=args.moe_policy, cache_slots=args.moe_cache_slots,
                                        params={"ratio": 0.5}), scheduler=SchedulerConfig(prefill_chunk=args.tokens))
    runner = ModelRunner(args.model, config, rows=1)
    prompt = torch.randint(0, 1000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    pages = runner.row_pages(0)
    runner.prefill(pages, prompt)  # warm: kernels compiled, allocator grown
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    runner.prefill(pages, prompt)
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        runner.prefill(pages, prompt)
        torch.cuda.synchronize()
    ka = prof.key_averages()
    text = (f"{args.tokens}-token chunk, warm: {warm:.3f} s ({args.tokens / warm:.0f} tok/s)\n"
            + ka.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=90)
            + "\n" + ka.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    out = Path(args.out)
    (out / "prefill-profile.txt").write_text(text)
    prof.export_chrome_trace(str(out / "prefill-trace.json"))
    print(text[:5000], flush=True)
    runner.close()


if __name__ == "__main__":
    main()
