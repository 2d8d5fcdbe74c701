"""Live resizes under load, with the default (auto-sized) expert cache.

    python -m benchmarks.resize_under_load --model DIR --out FILE [--device cuda] [--streams 16] \\
        [--max-tokens 96] [--resizes 5] [--moe-policy transfer] [--spare-gb 1.0]

One engine, prefix reuse off. First pass: `--streams` concurrent greedy streams, no resize (the
reference tokens). Then, on CUDA, the device is filled with a ballast tensor until only the
headroom and `--spare-gb` stay free: the auto-sized cache then holds all the free memory there
was, as on a device the expert pool exceeds. Second pass: the same streams while the expert
cache is resized `--resizes` times between 20% and 60% of the slots the free memory gave it and
the KV pool between two sizes (a shrink of one with a growth of the other, both ways), each
resize when a further share of the streams' tokens has come.

Reports failed requests (must be 0), whether every stream's tokens equal the first pass's (and
where the first one that differs does), each resize's duration and sizes, and the free device
memory after it. `transfer` computes every expert on the device, so its tokens do not depend on
the cache's size; `hybrid` moves experts between the CPU and the device with the size (equal
only up to the summation order). Writes JSON with the machine, command and commit.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time

import anyio
import torch

from freetoken.config import EngineConfig, GraphConfig, KvConfig, MoeConfig, SamplingParams, SchedulerConfig
from freetoken.engine.llm import AsyncLLM


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length + i % 7)] for i in range(count)]


async def run_streams(llm, batch: list[list[int]], params: SamplingParams, tag: str,
                      on_chunk=None) -> tuple[dict[int, list[int]], list[str]]:
    tokens: dict[int, list[int]] = {}
    failures: list[str] = []

    async def one(i: int) -> None:
        out = []
        try:
            async for chunk in llm.generate(batch[i], params, f"{tag}{i}"):
                out += chunk.token_ids
                if on_chunk is not None:
                    await on_chunk()
        except Exception as exc:
            failures.append(f"stream {i}: {type(exc).__name__}: {exc}")
        tokens[i] = out

    async with anyio.create_task_group() as tg:
        for i in range(len(batch)):
            tg.start_soon(one, i)
    return tokens, failures


class Progress:
    """Chunks received so far; `reach(n)` returns once n have come (or the streams ended)."""

    def __init__(self) -> None:
        self.count = 0
        self.done = False
        self.waiters: list[tuple[int, anyio.Event]] = []

    async def tick(self) -> None:
        self.count += 1
        for n, event in self.waiters:
            if self.count >= n:
                event.set()

    def finish(self) -> None:
        self.done = True
        for _, event in self.waiters:
            event.set()

    async def reach(self, n: int) -> None:
        if self.count < n and not self.done:
            event = anyio.Event()
            self.waiters.append((n, event))
            await event.wait()


def resize_plan(start_slots: int, resizes: int, kv_small: int, kv_large: int) -> list[tuple[int, int]]:
    """(expert slots, KV tokens) per resize: 20% of the starting slots with the large KV pool,
    then 60% with the small one, and so on."""
    low, high = max(1, round(0.2 * start_slots)), max(1, round(0.6 * start_slots))
    return [(low, kv_large) if i % 2 == 0 else (high, kv_small) for i in range(resizes)]


def ballast(spare_bytes: int, headroom_bytes: int) -> torch.Tensor | None:
    """Take the device's free memory but the headroom and `spare_bytes`."""
    if not torch.cuda.is_available():
        return None
    free = torch.cuda.mem_get_info()[0]
    take = free - headroom_bytes - spare_bytes
    return torch.empty(take, dtype=torch.uint8, device="cuda") if take > 0 else None


async def bench(args) -> dict:
    config = EngineConfig(model=args.model, device=args.device,
                          moe=MoeConfig(policy=args.moe_policy, cpu_threads=args.cpu_threads),
                          max_model_len=args.max_model_len, max_running_requests=args.streams,
                          kv=KvConfig(tokens=args.kv_small), scheduler=SchedulerConfig(prefix_reuse=False),
                          graphs=GraphConfig(eager=args.eager))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    started = time.perf_counter()
    async with AsyncLLM.start(config) as llm:
        print(f"engine started in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        batch = prompts(args.streams, args.prompt_tokens, llm.runner.model_config.vocab_size, args.seed)
        started = time.perf_counter()
        reference, ref_failures = await run_streams(llm, batch, params, "ref")
        reference_s = time.perf_counter() - started
        print(f"reference pass: {reference_s:.1f} s, {len(ref_failures)} failed", file=sys.stderr)
        held = ballast(int(args.spare_gb * 2**30), llm.runner.headroom_bytes)
        start = await llm.cache_status()
        plan = resize_plan(start["expert_slots"], args.resizes, args.kv_small, args.kv_large)
        total = args.streams * args.max_tokens
        progress = Progress()
        resizes: list[dict] = []

        async def resizer() -> None:
            for i, (slots, kv) in enumerate(plan):
                await progress.reach(total * (i + 1) // (len(plan) + 1))
                entry = {"moe_slots": slots, "kv_tokens": kv, "after_chunks": progress.count}
                t0 = time.perf_counter()
                try:
                    status = await llm.resize_cache(moe_slots=slots, kv_tokens=kv)
                    entry.update(ok=True, expert_slots=status["expert_slots"], kv_tokens_now=status["kv_tokens"],
                                 device_free_bytes=status["device_free_bytes"])
                except Exception as exc:
                    entry.update(ok=False, error=f"{type(exc).__name__}: {exc}")
                entry["seconds"] = time.perf_counter() - t0
                resizes.append(entry)
                print(f"resize {len(resizes)}: {entry}", file=sys.stderr)

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(resizer)
            tokens, failures = await run_streams(llm, batch, params, "load", progress.tick)
            progress.finish()  # (a resize still waiting runs now, after the streams)
        loaded_s = time.perf_counter() - started
        end = await llm.cache_status()
        # shapes whose graph capture failed and that ran eagerly instead (none expected)
        graphs = llm.runner.status().get("decode_graphs") or {}
        del held
    differs = {i: next((p for p, (a, b) in enumerate(zip(tokens[i], reference[i], strict=False)) if a != b),
                       min(len(tokens[i]), len(reference[i])))
               for i in reference if tokens.get(i) != reference[i]}
    return {
        "policy": start["policy"],
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "start": {k: start[k] for k in ("expert_slots", "pool_experts", "kv_tokens", "expert_slot_bytes",
                                        "device_free_bytes")},
        "end": {k: end[k] for k in ("expert_slots", "kv_tokens", "device_free_bytes")},
        "resizes": resizes,
        "resizes_ok": sum(r["ok"] for r in resizes),
        "failed_requests": len(failures) + len(ref_failures),
        "failures": (ref_failures + failures)[:10],
        "tokens_equal": not differs and not failures,
        "streams_differing": len(differs),
        "first_difference": {str(i): p for i, p in sorted(differs.items())},
        "graph_shapes_captured": len(graphs.get("captured", [])),
        "graph_capture_failures": graphs.get("capture_failures", 0),
        "reference_pass_s": reference_s,
        "resize_pass_s": loaded_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--moe-policy", default="transfer")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kv-small", type=int, default=16 * 512)
    p.add_argument("--kv-large", type=int, default=64 * 512)
    p.add_argument("--resizes", type=int, default=5)
    p.add_argument("--spare-gb", type=float, default=1.0, help="device memory left free beside the headroom")
    p.add_argument("--cpu-threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eager", action="store_true",
                   help="no decode graphs (each batch size and key bucket the streams reach is one more capture)")
    args = p.parse_args()
    result = anyio.run(bench, args)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    result.update(command=" ".join(["python -m benchmarks.resize_under_load", *sys.argv[1:]]), commit=commit,
                  machine={"device": device, "host": platform.node(), "python": platform.python_version(),
                           "torch": torch.__version__})
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("failed_requests", "tokens_equal", "resizes_ok", "streams_differing",
                                             "graph_capture_failures")}))


if __name__ == "__main__":
    main()
