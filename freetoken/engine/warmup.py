"""Start-up warm-up: the forwards a first request would compile run before the engine is ready.

On CUDA a shape's first forward compiles its Triton kernels, and the first decode step of a
(batch size, key bucket) captures its graph (engine/decode_graphs.py). Compilation holds the
GIL, so left to the first request it froze the whole server (seen on an H200, hybrid policy:
~24 s after the first token, /metrics and other clients' admissions unanswered). `AsyncLLM.start`
runs this before it yields the engine, so `serve` binds its port only once it is done: nothing
can reach a half-warm engine, and /health needs no "warming" state (the other way, a bound port
answering "not ready", would leave every client and probe to tell the two apart).

What it runs, straight on the ModelRunner (no Scheduler, no GpuRunner, so no request, metric,
KV page reservation or prefix-cache entry exists to be left behind):
- prefills of dummy prompts of 1, 5 and 16 tokens (Triton specialises integer arguments as 1,
  as multiples of 16 or neither: each is its own compile), and of `prefill_stream_min_tokens`
  and one more where a chunk that long can occur: such chunks take the streamed / grouped
  expert path (cache/prefill_stream.py, moe/resident_layer.py). Each streamed prefill moves
  every offloaded expert once over PCIe, as a user's long chunk would (the host pool's bytes
  over the link's bandwidth): the price of not freezing on the first long prompt;
- decode steps at each batch size the decode graphs capture and, with the fused kernels, at
  each key bucket up to the context (graphs are captured per (batch, bucket), and the decode
  attention picks its key splits, compile-time constants, by both): every row the dummy
  sequence, the very rows graph padding repeats. Eager decode warms batch_sizes_for(rows)
  (CUDA kernels specialise on a batch of 1). The CPU runs no Triton and would need batch 1
  alone, but the other sizes cost it next to nothing (benchmarks/results/warmup-cost-cpu.json,
  2-core box, median of 15: the demo model's whole warm-up 0.037 s at batch 1, 0.045 s at 1, 2,
  4; the tests' tiny hybrid 0.016 s and 0.021 s), so the CPU takes eager CUDA's rule and the
  tests walk its path (several recurrent-state slots held and given back).

Afterwards every trace of it that users could see is undone: the expert cache's counters are
zeroed and the live bandwidth samples dropped (the link figures then come from served work
alone), recurrent-state slots are released in reverse order (the free list as it was). Which
experts the slots hold is left as the warm-up's routing left them, as any earlier request would
leave them: in fp32 outputs do not depend on placement (tests/test_placement_invariance.py); in
bf16 CPU and GPU experts round apart, so hybrid's tokens may differ from a cold start's. A
routing replay is drawn step by step, so with one the warm-up is skipped (it would consume the
replay's first steps).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from freetoken.cache.slot_cache import STAT_FIELDS
from freetoken.config import EngineConfig
from freetoken.engine.decode_graphs import batch_sizes_for, key_bucket
from freetoken.engine.model_runner import ModelRunner

SHORT_PROMPTS = (1, 5, 16)  # a token count Triton specialises as 1, as neither, as a multiple of 16


@dataclass
class WarmupReport:
    seconds: float
    prefill_lengths: list[int]
    batch_sizes: list[int]
    key_buckets: list[int]  # empty: exact key lengths (the reference ops), nothing compiled per length

    def summary(self) -> str:
        prefill = ", ".join(map(str, self.prefill_lengths))
        batches = ", ".join(map(str, self.batch_sizes))
        keys = f", keys {self.key_buckets[0]} to {self.key_buckets[-1]}" if self.key_buckets else ""
        return f"warm-up: {self.seconds:.1f} s (prefill {prefill} tokens, decode at batch {batches}{keys})"


def warm_batch_sizes(runner: ModelRunner) -> list[int]:
    """The decode batch sizes whose first step would compile or capture something."""
    if runner.graphs is not None:
        return list(runner.graphs.batch_sizes)
    return batch_sizes_for(runner.rows)


def warm_prefill_lengths(runner: ModelRunner, config: EngineConfig) -> list[int]:
    """The dummy prompts' lengths: the short ones, and two at the streaming threshold where a
    prefill chunk can be that long; each leaves room for a decode position after it."""
    stream = config.moe.prefill_stream_min_tokens
    streamed = () if stream is None else (stream, stream + 1)
    return sorted({n for n in (*SHORT_PROMPTS, *streamed) if n < runner.max_len
                   and (n in SHORT_PROMPTS or n <= config.scheduler.prefill_chunk)})


def warm_decode_positions(runner: ModelRunner, first: int) -> list[int]:
    """Decode positions, one per key bucket a step can meet (from `first`'s up to the context's)
    where the fused kernels pad keys to buckets; the reference ops attend exact lengths: `first`."""
    if not runner.fused:
        return [first]
    positions, bucket = [first], 2 * key_bucket(first + 1)
    while bucket // 2 < runner.max_len:  # position bucket/2 attends bucket/2 + 1 keys: that bucket
        positions.append(bucket // 2)
        bucket *= 2
    return positions


def warm_up(runner: ModelRunner, config: EngineConfig) -> WarmupReport | None:
    """Run the warm-up forwards, then undo their traces (module docstring). None: skipped (a
    routing replay)."""
    if runner.routing is not None and runner.routing.replay is not None:
        return None
    started = time.perf_counter()
    lengths, sizes = warm_prefill_lengths(runner, config), warm_batch_sizes(runner)
    vocab = runner.model_config.vocab_size
    held: list[int] = []
    after_short = max((n for n in lengths if n in SHORT_PROMPTS), default=None)  # (none: a one-token context)
    positions = [] if after_short is None else warm_decode_positions(runner, after_short)
    try:
        # nothing is allocated yet: the first pages are as good as any (KV reads as zeros)
        pages = list(range(-(-(max([*lengths, *positions], default=0) + 1) // runner.cache.page_size)))
        slot = None
        if runner.states is not None:
            slot = runner.states.acquire()
            held.append(slot)
        for n in lengths:
            runner.prefill(pages, [i % vocab for i in range(n)], state_slot=slot)
        for b in sizes if positions else []:
            slots = None
            if runner.states is not None:
                while len(held) < b:
                    held.append(runner.states.acquire())
                slots = held[:b]
            for p in positions:  # (a step at position p rewrites that key, nothing more)
                runner.decode([pages] * b, [p % vocab] * b, [p] * b, slots).cpu()
    finally:
        for s in reversed(held):
            runner.states.release(s)
        forget_counters(runner)
    buckets = []
    if runner.fused and positions:
        buckets = [key_bucket(p + 1) for p in positions]
    return WarmupReport(time.perf_counter() - started, lengths, sizes if positions else [], buckets)


def forget_counters(runner: ModelRunner) -> None:
    """Zero what the warm-up added to the expert cache's counters and the live bandwidths, after
    folding in what is still on the device or pending (so a later fold does not bring it back)."""
    runner.settle_fills()
    runner.status()  # folds the graphs' device counters and the eager fills' pending timings
    stats = runner.slots.stats
    for name in STAT_FIELDS:
        counts = getattr(stats, name)
        counts[:] = [0] * len(counts)  # in place, as every writer of them adds
    runner.model.backend.live.clear()
