"""GpuRunner: the actor that owns the device, the weights, the KV cache and the sampler.

Each step runs in this actor's worker thread (`run_blocking`), so the event loop keeps
serving HTTP while kernels run, and steps execute in the order they were sent.
"""

from __future__ import annotations

import logging

import torch

from freetoken.actors.messages import DecodeStep, DropAnchors, PrefillStep, Release, ResizePools
from freetoken.actors.runtime import Actor, handles
from freetoken.config import SamplingParams
from freetoken.engine.model_runner import ModelRunner
from freetoken.engine.sampler import Sampled, Sampler
from freetoken.errors import EngineError, RequestError

log = logging.getLogger(__name__)


class GpuRunner(Actor):
    def __init__(self, runner: ModelRunner) -> None:
        super().__init__("gpu_runner")
        self.runner = runner
        self.sampler = Sampler(runner.device)
        self.generators: dict[str, torch.Generator | None] = {}
        self.state_slots: dict[str, int] = {}  # request -> its recurrent-state slot (linear-attention models)
        # anchor digest -> the recurrent state saved there, in host memory (cache/state_anchors.py)
        self.anchor_states: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}

    def _state_slot(self, msg: PrefillStep) -> int | None:
        """A sequence's recurrent-state slot, taken at its first prefill chunk and kept until
        Release: zeroed, or holding the anchor's saved state the sequence resumes from."""
        states = self.runner.states
        if states is None:
            return None
        slot = self.state_slots.get(msg.request_id)
        if slot is None:
            saved = self.anchor_states.get(msg.restore_anchor) if msg.restore_anchor is not None else None
            if msg.start and saved is None:
                raise EngineError(f"{msg.request_id}: prefill from position {msg.start} without a saved state")
            slot = self.state_slots[msg.request_id] = states.acquire()
            if saved is not None:
                states.load(slot, saved)
        return slot

    def _prefill(self, msg: PrefillStep) -> Sampled | None:
        with self.trace.span(self.name, "prefill", tokens=len(msg.token_ids), start=msg.start):
            self.runner.set_context([msg.request_id], "prefill", [0])
            slot = self._state_slot(msg)
            logits = self.runner.prefill(msg.pages, msg.token_ids, start=msg.start, state_slot=slot)
            if msg.save_anchor is not None and slot is not None:
                self.anchor_states[msg.save_anchor] = self.runner.states.snapshot(slot)
            return self._sample(logits, [msg.request_id], [msg.params])[0] if msg.last else None

    def _decode(self, msg: DecodeStep) -> list[Sampled]:
        with self.trace.span(self.name, "decode", batch=len(msg.page_tables)):
            self.runner.set_context(msg.request_ids, "decode", msg.steps)
            slots = None if self.runner.states is None else [self.state_slots[r] for r in msg.request_ids]
            logits = self.runner.decode(msg.page_tables, msg.tokens, msg.positions, slots)
            return self._sample(logits, msg.request_ids, msg.params)

    def _sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[Sampled]:
        for rid, p in zip(request_ids, params, strict=True):
            if rid not in self.generators:
                self.generators[rid] = self.sampler.generator_for(p)
        return self.sampler.sample(logits, params, [self.generators[rid] for rid in request_ids])

    @handles(PrefillStep)
    async def prefill(self, msg: PrefillStep) -> None:
        await self._step(self._prefill, msg)

    @handles(DecodeStep)
    async def decode(self, msg: DecodeStep) -> None:
        await self._step(self._decode, msg)

    async def _step(self, fn, msg) -> None:
        """A failing step fails its own sequences (the Scheduler ends them with an error), not
        the engine: the next step may well succeed. A device that keeps failing fails every
        request that reaches it, each with the reason."""
        try:
            result = await self.run_blocking(fn, msg)
        except Exception as exc:
            log.exception("%s failed", type(msg).__name__)
            msg.reply.fail(EngineError(f"{type(exc).__name__}: {exc}"))
            return
        msg.reply.set(result)

    @handles(ResizePools)
    async def resize(self, msg: ResizePools) -> None:
        """Between steps (the Scheduler sends this only then). A RequestError leaves both caches as they were."""
        try:
            await self.run_blocking(self.runner.resize, msg.moe_slots, msg.kv_pages, msg.page_map)
        except RequestError as exc:  # rejected before anything was freed: the actor lives on
            msg.reply.fail(exc)
            return
        msg.reply.set(self.runner.status())

    @handles(DropAnchors)
    async def drop_anchors(self, msg: DropAnchors) -> None:
        for key in msg.keys:
            self.anchor_states.pop(key, None)

    @handles(Release)
    async def release(self, msg: Release) -> None:
        self.generators.pop(msg.request_id, None)
        slot = self.state_slots.pop(msg.request_id, None)
        if slot is not None:
            self.runner.states.release(slot)
