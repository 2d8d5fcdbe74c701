"""AsyncLLM: the engine as the front ends see it (see engine/protocol.py).

`async with AsyncLLM.start(config) as llm:` loads the model, starts the actors (Scheduler,
GpuRunner) and stops them on exit. `llm.generate(...)` validates a request, submits it to the
Scheduler and streams CompletionChunks from the request's outbox. Inside a step the runner's
thread calls the expert hierarchy's mechanisms (the CPU executor's doorbell worker, the copy
stream) directly: a message per layer through the event loop would cost more than the layer.
"""

from __future__ import annotations

import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio

from freetoken.actors.gpu_runner import GpuRunner
from freetoken.actors.messages import ResizeCaches, Submit
from freetoken.actors.runtime import ActorSystem, Outbox
from freetoken.actors.scheduler import Scheduler
from freetoken.cache.live_bandwidth import link_gauges
from freetoken.cache.state_anchors import ANCHOR_TOKENS, AnchorIndex
from freetoken.config import EngineConfig, ModelConfig, SamplingParams
from freetoken.engine.model_runner import ModelRunner
from freetoken.engine.protocol import CompletionChunk
from freetoken.errors import EngineError, RequestError
from freetoken.loader.paths import is_gguf
from freetoken.loader.tokenizer import Tokenizer
from freetoken.trace import NULL_RECORDER, TraceRecorder


def resolve_model_dir(config: EngineConfig) -> Path:
    if config.model == "demo":
        from freetoken.loader.synth import ensure_demo_checkpoint

        return ensure_demo_checkpoint(Path(config.cache_dir).expanduser())
    return Path(config.model)


def anchor_index(runner: ModelRunner, tokenizer: Tokenizer, config: EngineConfig) -> AnchorIndex | None:
    """Where a model with recurrent state saves it for prefix reuse: at its template's message and
    tool-exchange tokens and each prompt's end (None: no recurrent state, or no prefix reuse)."""
    if runner.states is None or not config.scheduler.prefix_reuse:
        return None
    ids = frozenset(i for i in map(tokenizer.token_to_id, ANCHOR_TOKENS) if i is not None)
    return AnchorIndex(runner.cache.page_size, ids, runner.states.slot_bytes,
                       int(config.scheduler.state_anchor_gb * 2**30), config.scheduler.anchor_min_gap)


def model_name(path: Path) -> str:
    """The served name: the directory's, or the GGUF file's without its suffix (and split part)."""
    if not is_gguf(path):
        return path.name
    return re.sub(r"-00001-of-\d{5}$", "", path.stem)


def open_checkpoint(model_dir: Path, config: EngineConfig) -> Tokenizer:
    """Everything about a checkpoint that can be refused before its weights are read (the
    config's consistency, the tokenizer against the vocabulary, the context against a sliding
    window): a bad download fails at start with the file and field, never in every request."""
    model_config = ModelConfig.from_checkpoint(model_dir)
    source = str(model_dir) if is_gguf(model_dir) else str(model_dir / "config.json")
    model_config.check_context(min(config.max_model_len, model_config.max_position_embeddings), source)
    tokenizer = Tokenizer.from_checkpoint(model_dir)
    tokenizer.check_model_vocab(model_config.vocab_size)
    return tokenizer


class AsyncLLM:
    def __init__(
        self,
        system: ActorSystem,
        scheduler: Scheduler,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        name: str,
        recorder: TraceRecorder = NULL_RECORDER,
    ):
        self.system = system
        self.recorder = recorder
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_name = name

    @property
    def arch(self) -> str:
        """The model family (`ModelConfig.arch`): front ends pick tool-call formats by it."""
        return self.runner.model_config.arch

    @property
    def max_model_len(self) -> int:
        return self.runner.max_len

    @classmethod
    @asynccontextmanager
    async def start(cls, config: EngineConfig) -> AsyncIterator[AsyncLLM]:
        config.validate()
        recorder = TraceRecorder() if config.trace.timeline else NULL_RECORDER
        model_dir = await anyio.to_thread.run_sync(resolve_model_dir, config)
        tokenizer = await anyio.to_thread.run_sync(open_checkpoint, model_dir, config)
        runner = await anyio.to_thread.run_sync(
            lambda: ModelRunner(str(model_dir), config, config.max_running_requests, recorder)
        )
        print(f"[freetoken] loaded {model_dir} ({runner.model_config.arch}) on {runner.device} {runner.dtype}: "
              f"{runner.report.summary()}", file=sys.stderr)
        name = config.served_model_name or ("demo" if config.model == "demo" else model_name(model_dir))
        try:
            async with ActorSystem(recorder) as system:
                gpu = system.spawn(GpuRunner(runner))
                eos = tokenizer.eos_token_ids or runner.model_config.eos_token_ids
                scheduler = system.spawn(
                    Scheduler(gpu, tokenizer, eos, max_running=config.max_running_requests, max_len=runner.max_len,
                              kv_pages=runner.cache.num_pages, page_size=runner.cache.page_size,
                              prefill_chunk=config.scheduler.prefill_chunk, prefix_reuse=config.scheduler.prefix_reuse,
                              anchors=anchor_index(runner, tokenizer, config))
                )
                yield cls(system, scheduler, runner, tokenizer, name, recorder)
        finally:
            runner.close()
            if config.trace.timeline:
                recorder.write_perfetto(config.trace.timeline)
                print(f"[freetoken] trace written to {config.trace.timeline}", file=sys.stderr)

    def health(self) -> dict:
        """GET /health: the engine's state, read from what the actors hold without asking them
        (no device sync, no wait behind a step). "ready" while every actor runs; "degraded"
        once one has failed (a failed actor stays failed)."""
        s, r = self.scheduler, self.runner
        return {
            "status": "ok" if self.system.healthy else "degraded",
            "model": self.model_name,
            "arch": self.arch,
            "device": str(r.device),
            "ready": self.system.healthy,
            "actors": self.system.health(),
            "requests": {"running": len(s.running), "waiting": len(s.waiting)},
            "moe_policy": r.slots.policy.name,
            "expert_slots": r.slots.num_slots,
            "kv_pages": r.cache.num_pages,
            "kv_pages_free": len(s.prefix.free),
            "kv_pages_available": s.prefix.available,  # free plus cached pages no request holds
            "prefix_reuse": s.prefix_reuse,
            # linear-attention models: the recurrent states saved at anchors, for prefix reuse
            "state_anchors": None if s.anchors is None else {
                "kept": len(s.anchors), "capacity": s.anchors.capacity, "bytes": s.anchors.nbytes},
        }

    async def cache_status(self) -> dict:
        """The memory split and the cache counters: policy, slots, KV bytes, hit rate."""
        return self.runner.status()

    async def resize_cache(self, moe_slots: int | None, kv_tokens: int | None) -> dict:
        if moe_slots is None and kv_tokens is None:
            raise RequestError("give moe_slots and/or kv_tokens", param="moe_slots")
        for name, value in (("moe_slots", moe_slots), ("kv_tokens", kv_tokens)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise RequestError(f"{name} must be a positive integer, got {value!r}", param=name)
        # The scheduler applies it between two steps (no step in flight while the caches change).
        return await self.scheduler.ask(lambda r: ResizeCaches(moe_slots=moe_slots, kv_tokens=kv_tokens, reply=r))

    def metrics(self) -> dict:
        s = self.scheduler
        out = s.metrics.snapshot(running=len(s.running), waiting=len(s.waiting))
        cache = self.runner.status()
        out["counters"].update({
            "expert_cache_hits_total": cache["hits"], "expert_cache_misses_total": cache["misses"],
            "experts_fetched_total": cache["experts_fetched"], "pcie_bytes_total": cache["bytes_fetched"],
            "prefill_stream_pcie_bytes_total": cache["prefill_bytes_streamed"],
            "cpu_expert_routes_total": cache["cpu_routes"],
        })
        out["gauges"].update({
            "expert_cache_hit_rate": cache["hit_rate"], "expert_slots": cache["expert_slots"],
            "kv_tokens": cache["kv_tokens"],
            "expert_link_bytes_per_second": link_gauges(cache["live_bandwidth"], cache["profile_bandwidth"]),
            "expert_split_pcie_share": cache["split_ratio"],
        })
        split, choice = cache["live_split"], cache["live_policy"]
        if split is not None:
            out["gauges"]["expert_split_estimate_bytes_per_second"] = [
                ({"link": "pcie_fill"}, split["pcie_fill_bytes_per_s"]),
                ({"link": "cpu_expert"}, split["cpu_expert_bytes_per_s"])]
        if cache["live_cpu_threads"] is not None:
            out["gauges"]["cpu_expert_threads"] = cache["live_cpu_threads"]["threads"]
        if choice is not None:
            out["gauges"]["moe_policy_mode"] = [({"mode": m}, float(m == choice["mode"])) for m in choice["mode_steps"]]
            out["counters"].update({"moe_policy_probes_total": choice["probes"],
                                    "moe_policy_switches_total": choice["switches"],
                                    "moe_policy_mode_steps_total": [({"mode": m}, n)
                                                                    for m, n in choice["mode_steps"].items()]})
        return out

    def recent_spans(self, limit: int) -> list[dict]:
        """The tracer's last spans (empty unless the engine was started with a trace file)."""
        return self.recorder.recent_spans(limit)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        if not prompt_token_ids:
            raise RequestError("the prompt is empty", param="prompt")
        vocab = self.runner.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context is {self.max_model_len} "
                "tokens, prompt and output together",
                param="messages",
            )

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[CompletionChunk]:
        self.check_request(prompt_token_ids, params)
        outbox: Outbox[CompletionChunk] = Outbox()
        await self.scheduler.send(
            Submit(request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params, outbox=outbox)
        )
        try:
            async for chunk in outbox:
                yield chunk
        except EngineError as exc:
            self.scheduler.metrics.requests_failed_total += 1
            yield CompletionChunk(text="", token_ids=[], finish_reason="error", error=str(exc))
        finally:
            # The scheduler sees the consumer gone at its next step and frees the KV row.
            await outbox.aclose()
