"""Scheduler: requests in, batched steps out, chunks back to each request's outbox.

Plain Python over ints and deques. Each step runs at most one prefill chunk (of at most
`prefill_chunk` tokens) and then one decode step for every sequence that has its first token,
so a long prompt delays running streams by one chunk, not by its whole prefill.

KV memory is paged (cache/prefix_cache.py): at admission a sequence shares the cached pages
its prompt starts with (a system prompt, an agent's previous turn) and gets private pages for
the rest of its prompt and its output budget, so it can never run out mid-generation. When it
finishes, its full pages join the prefix cache for the next turn.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import anyio

from freetoken.actors.messages import (
    DecodeStep,
    DropAnchors,
    PrefillStep,
    Release,
    ResizeCaches,
    ResizePools,
    Submit,
    Tick,
)
from freetoken.actors.runtime import Actor, Outbox, handles
from freetoken.cache.live_resize import ResizeRolledBack
from freetoken.cache.prefix_cache import Node, PrefixCache
from freetoken.cache.state_anchors import AnchorIndex, prefix_digests
from freetoken.config import SamplingParams
from freetoken.engine.detokenizer import Decoder, IncrementalText
from freetoken.engine.metrics import EngineMetrics
from freetoken.engine.protocol import CompletionChunk, FinishReason
from freetoken.engine.sampler import Sampled
from freetoken.errors import EngineError


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    outbox: Outbox
    text: IncrementalText
    stop_ids: frozenset[int]
    submitted: float
    shared: list[Node] = field(default_factory=list)  # cached prefix pages it reads
    own_pages: list[int] = field(default_factory=list)  # pages it writes
    computed: int = 0  # prompt tokens whose KV is in its pages
    cached: int = 0  # of those, reused from an earlier sequence
    output: list[int] = field(default_factory=list)
    # linear-attention models: the prompt's prefix digests by page boundary, the anchors still
    # ahead of its prefill, and the anchor its state resumes from
    digests: dict[int, bytes] = field(default_factory=dict)
    anchors_ahead: list[int] = field(default_factory=list)
    restore_anchor: bytes | None = None

    @property
    def pages(self) -> list[int]:
        return [n.page for n in self.shared] + self.own_pages

    @property
    def last_position(self) -> int:
        """Where the newest token sits (it is fed back at this position)."""
        return len(self.prompt) + len(self.output) - 1

    @property
    def in_kv(self) -> list[int]:
        """The tokens whose KV its pages hold (the newest sampled token is not fed yet)."""
        if not self.output:
            return self.prompt[: self.computed]
        return self.prompt + self.output[:-1]


class Scheduler(Actor):
    def __init__(
        self, runner: Actor, decoder: Decoder, eos_ids: tuple[int, ...], max_running: int, max_len: int,
        kv_pages: int, page_size: int, prefill_chunk: int = 2048, prefix_reuse: bool = True,
        anchors: AnchorIndex | None = None,
    ) -> None:
        """anchors: for models with recurrent state, where their states are saved for reuse
        (cache/state_anchors.py); a shared prefix then resumes only from one of them."""
        super().__init__("scheduler", mailbox_size=1024)
        self.runner = runner
        self.decoder = decoder
        self.eos_ids = frozenset(eos_ids)
        self.max_len = max_len
        self.prefill_chunk = prefill_chunk
        self.prefix_reuse = prefix_reuse
        self.max_running = max_running
        self.prefix = PrefixCache(kv_pages, page_size)
        self.anchors = anchors
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # admitted: prefilling or decoding
        self.metrics = EngineMetrics()
        self._tick_pending = False

    # -- messages -----------------------------------------------------------------------------
    @handles(Submit)
    async def submit(self, msg: Submit) -> None:
        p = msg.params
        stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_ids)
        text = IncrementalText(self.decoder, p.stop, p.skip_special_tokens)
        self.waiting.append(
            Sequence(msg.request_id, msg.prompt_token_ids, p, msg.outbox, text, stop_ids, time.perf_counter())
        )
        self.metrics.requests_total += 1
        self.metrics.prompt_tokens_total += len(msg.prompt_token_ids)
        self._kick()

    @handles(Tick)
    async def tick(self, msg: Tick) -> None:
        self._tick_pending = False
        await self._step()
        if self.waiting or self.running:
            self._kick()

    @handles(ResizeCaches)
    async def resize(self, msg: ResizeCaches) -> None:
        """Applied here, between two steps: no step is in flight while the caches change."""
        kv_pages, page_map, keep_cached = None, {}, True
        if msg.kv_tokens is not None:
            kv_pages = self.prefix.pages_for(msg.kv_tokens)
            in_use = sorted({p for s in self.running.values() for p in s.pages})
            cached = [n.page for n in self.prefix.nodes() if n.refs == 0]
            keep_cached = len(in_use) + len(cached) <= kv_pages
            page_map = kept_page_map(in_use + cached if keep_cached else in_use, kv_pages)
        try:
            status = await self.runner.ask(
                lambda r: ResizePools(moe_slots=msg.moe_slots, kv_pages=kv_pages, page_map=page_map, reply=r))
        except Exception as exc:  # refused (nothing changed) or rolled back
            if isinstance(exc, ResizeRolledBack) and not keep_cached:
                self.prefix.clear()  # moved pages may have landed on the cached pages it meant to drop
            msg.reply.fail(exc)
            return
        if kv_pages is not None:
            if not keep_cached:
                self.prefix.clear()
            self.prefix.remap(page_map, kv_pages)
            for seq in self.running.values():
                seq.own_pages = [page_map[p] for p in seq.own_pages]
            self.max_len = status["max_model_len"]
        msg.reply.set(status)

    def _kick(self) -> None:
        if not self._tick_pending:
            self._tick_pending = True
            try:
                self.send_nowait(Tick())
            except anyio.WouldBlock:  # the mailbox is full of work; a Tick will follow it
                self._tick_pending = False

    # -- one step -----------------------------------------------------------------------------
    async def _step(self) -> None:
        for seq in [s for s in self.running.values() if s.outbox.consumer_gone]:
            await self._retire(seq)
        for seq in [s for s in self.waiting if s.outbox.consumer_gone]:
            self.waiting.remove(seq)
            seq.outbox.close()
            self.metrics.requests_finished_total += 1
        if self.waiting and len(self.running) < self.max_running and self._admit(self.waiting[0]):
            self.waiting.popleft()
        if self.prefilling:
            await self._prefill_chunk(self.prefilling[0])
        batch = [s for s in self.running.values() if s.output]
        if batch:
            await self._decode(batch)

    def _admit(self, seq: Sequence) -> bool:
        """Share the cached pages the prompt starts with, reserve private pages for the rest of
        the prompt and the output budget; False (nothing held) when pages are short."""
        ps = self.prefix.page_size
        restore = None
        shared = self.prefix.match(seq.prompt) if self.prefix_reuse else []
        while shared and len(shared) * ps >= len(seq.prompt):
            shared.pop()  # at least one prompt token must be prefilled, to get logits
        if self.anchors is not None:
            # recurrent state: resume only where a state was saved, from the deepest such prefix
            seq.digests = prefix_digests(seq.prompt, ps, len(seq.prompt))
            resume = self.anchors.deepest(seq.digests, len(shared) * ps)  # (0 without shared pages)
            shared = shared[: resume // ps]
            restore = seq.digests[resume] if resume else None
            seq.anchors_ahead = [n for n in self.anchors.positions(seq.prompt) if n > resume]
        budget = min(len(seq.prompt) + seq.params.max_tokens, self.max_len)
        self.prefix.acquire(shared)
        own = self.prefix.allocate(self.prefix.pages_for(budget) - len(shared))
        if own is None:
            self.prefix.unacquire(shared)
            return False
        if restore is not None:  # kept until its first chunk has restored it
            seq.restore_anchor = restore
            self.anchors.hold(restore)
        seq.shared, seq.own_pages = shared, own
        seq.cached = seq.computed = len(shared) * ps
        self.metrics.cached_prompt_tokens_total += seq.cached
        self.running[seq.request_id] = seq
        self.prefilling.append(seq)
        return True

    async def _prefill_chunk(self, seq: Sequence) -> None:
        start = seq.computed
        end = min(start + self.prefill_chunk, len(seq.prompt))
        save = None
        if seq.anchors_ahead:  # a chunk ends at the next anchor, to save the state there
            end, at_anchor = self.anchors.chunk_end(seq.anchors_ahead, start, end)
            key = seq.digests[end] if at_anchor else None
            save = key if key is not None and self.anchors.capacity and key not in self.anchors else None
        chunk = seq.prompt[start:end]
        last = end == len(seq.prompt)
        restore = seq.restore_anchor if start == seq.cached else None
        try:
            sampled = await self.runner.ask(
                lambda r: PrefillStep(request_id=seq.request_id, pages=seq.pages, token_ids=chunk, start=start,
                                      last=last, params=seq.params, reply=r, restore_anchor=restore,
                                      save_anchor=save)
            )
        except EngineError as exc:
            await self._step_failed([seq], exc)
            return
        finally:
            if restore is not None:
                self._unhold_restore(seq)
        if save is not None:
            dropped = self.anchors.add(save)
            if dropped:
                await self.runner.send(DropAnchors(dropped))
        seq.computed += len(chunk)
        if last:
            self.prefilling.popleft()
            self.metrics.observe_ttft(time.perf_counter() - seq.submitted)
            await self._emit(seq, sampled)

    async def _decode(self, batch: list[Sequence]) -> None:
        started = time.perf_counter()
        try:
            sampled = await self.runner.ask(lambda r: self._decode_step(batch, r))
        except EngineError as exc:
            await self._step_failed(batch, exc)
            return
        self.metrics.observe_decode(time.perf_counter() - started, len(batch))
        for seq, one in zip(batch, sampled, strict=True):
            await self._emit(seq, one)

    @staticmethod
    def _decode_step(batch: list[Sequence], reply) -> DecodeStep:
        return DecodeStep(
            request_ids=[s.request_id for s in batch],
            page_tables=[s.pages for s in batch],
            tokens=[s.output[-1] for s in batch],
            positions=[s.last_position for s in batch],
            steps=[len(s.output) for s in batch],
            params=[s.params for s in batch],
            reply=reply,
        )

    async def _step_failed(self, seqs: list[Sequence], exc: EngineError) -> None:
        """A step failed: its sequences end with the error; the engine goes on, unless the
        runner itself is gone (then this actor fails too, failing every request it holds)."""
        if self.runner.status != "running":
            raise exc
        for seq in seqs:
            seq.outbox.fail(exc)
            await self._retire(seq)

    async def _emit(self, seq: Sequence, sampled: Sampled) -> None:
        if sampled.error is not None:
            await self._step_failed([seq], EngineError(sampled.error))
            return
        token = sampled.token
        seq.output.append(token)
        self.metrics.generation_tokens_total += 1
        finish: FinishReason | None = None
        text = ""
        if token in seq.stop_ids:
            finish = "stop"
            text = seq.text.flush()  # text held back for a stop string that never came
        else:
            text = seq.text.add(token)
            if seq.text.stopped:
                finish = "stop"
            elif len(seq.output) >= seq.params.max_tokens or seq.last_position + 1 >= self.max_len:
                finish = "length"
        if finish == "length":
            text += seq.text.flush()
        chunk = CompletionChunk(
            text=text,
            token_ids=[token],
            finish_reason=finish,
            prompt_tokens=len(seq.prompt),
            completion_tokens=len(seq.output),
            cached_tokens=seq.cached,
            logprobs=[sampled.logprob] if sampled.logprob is not None else None,
        )
        delivered = seq.outbox.put(chunk)  # False: the client went away
        if finish is not None or not delivered:
            await self._retire(seq)

    def _unhold_restore(self, seq: Sequence) -> None:
        if seq.restore_anchor is not None:
            self.anchors.unhold(seq.restore_anchor)
            seq.restore_anchor = None

    async def _retire(self, seq: Sequence) -> None:
        self._unhold_restore(seq)  # (a sequence ended before its first chunk)
        self.running.pop(seq.request_id, None)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        self.prefix.release(seq.shared, seq.in_kv, seq.own_pages)
        self.metrics.requests_finished_total += 1
        seq.outbox.close()
        await self.runner.send(Release(seq.request_id))


def kept_page_map(kept: list[int], num_pages: int) -> dict[int, int]:
    """old id -> new id for the KV pages a pool of `num_pages` keeps: pages below the new end stay
    where they are, the others move into the pages below it that nothing keeps (the pool
    resizes in place: no page moves onto one still to be read)."""
    kept_set = set(kept)
    holes = (p for p in range(num_pages) if p not in kept_set)  # (lazy: a pool may be asked to grow hugely)
    return {p: p if p < num_pages else next(holes) for p in kept}
