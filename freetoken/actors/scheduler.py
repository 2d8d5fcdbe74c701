"""Scheduler: requests in, batched steps out, chunks back to each request's outbox.

Plain Python over ints and deques. Each step runs at most one prefill chunk (of at most
`prefill_chunk` tokens) and then one decode step for every sequence that has its first token,
so a long prompt delays running streams by one chunk, not by its whole prefill.

KV rows are the unit of memory: a sequence holds one from admission to finish. A finished
row keeps what its KV holds (`row_tokens`), and a new request takes the free row sharing the
longest token prefix with its prompt, prefilling only the rest: an agent's next turn extends
its last one, so it re-prefills only the new suffix.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import anyio

from freetoken.actors.messages import DecodeStep, PrefillStep, Release, ResizeCaches, Submit, Tick
from freetoken.actors.runtime import Actor, Outbox, handles
from freetoken.config import SamplingParams
from freetoken.engine.detokenizer import Decoder, IncrementalText
from freetoken.engine.metrics import EngineMetrics
from freetoken.engine.protocol import CompletionChunk, FinishReason
from freetoken.engine.sampler import Sampled


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    outbox: Outbox
    text: IncrementalText
    stop_ids: frozenset[int]
    submitted: float
    row: int = -1
    computed: int = 0  # prompt tokens whose KV is in the row
    cached: int = 0  # of those, reused from an earlier sequence
    output: list[int] = field(default_factory=list)

    @property
    def last_position(self) -> int:
        """Where the newest token sits (it is fed back at this position)."""
        return len(self.prompt) + len(self.output) - 1

    @property
    def in_kv(self) -> list[int]:
        """The tokens whose KV the row holds (the newest sampled token is not fed yet)."""
        return self.prompt + self.output[:-1]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Scheduler(Actor):
    def __init__(
        self, runner: Actor, decoder: Decoder, eos_ids: tuple[int, ...], rows: int, max_len: int,
        prefill_chunk: int = 2048,
        prefix_reuse: bool = True,
    ) -> None:
        super().__init__("scheduler", mailbox_size=1024)
        self.runner = runner
        self.decoder = decoder
        self.eos_ids = frozenset(eos_ids)
        self.max_len = max_len
        self.prefill_chunk = prefill_chunk
        self.prefix_reuse = prefix_reuse
        self.free_rows: dict[int, float] = dict.fromkeys(range(rows), 0.0)  # row -> when freed (LRU)
        self.row_tokens: dict[int, list[int]] = {}  # what a free row's KV still holds
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # rows held, prefilling or decoding
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
        # Running sequences keep their KV; each needs room for at least its next token (one
        # that then reaches the new end of the row finishes with "length", not an error).
        msg.min_kv_len = max((s.last_position + 2 if s.output else len(s.prompt) + 1
                              for s in self.running.values()), default=1)
        try:
            status = await self.runner.ask(
                lambda r: ResizeCaches(moe_slots=msg.moe_slots, kv_tokens=msg.kv_tokens, min_kv_len=msg.min_kv_len,
                                       reply=r)
            )
        except Exception as exc:
            msg.reply.fail(exc)
            return
        if msg.kv_tokens is not None:
            self.max_len = status["kv_max_len"]
            self.row_tokens.clear()  # a resized KV cache starts without reusable rows
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
        self.waiting = deque(s for s in self.waiting if not s.outbox.consumer_gone)
        if self.waiting and self.free_rows:
            self._admit(self.waiting.popleft())
        if self.prefilling:
            await self._prefill_chunk(self.prefilling[0])
        batch = [s for s in self.running.values() if s.output]
        if batch:
            await self._decode(batch)

    def _admit(self, seq: Sequence) -> None:
        """Give the sequence the free row whose KV shares the longest prefix with its prompt
        (else the least recently freed row), and skip prefilling that prefix."""
        def score(row: int) -> tuple[int, float]:
            shared = common_prefix(self.row_tokens.get(row, []), seq.prompt) if self.prefix_reuse else 0
            return shared, -self.free_rows[row]

        row = max(self.free_rows, key=score)
        shared = score(row)[0]
        del self.free_rows[row]
        self.row_tokens.pop(row, None)
        seq.row = row
        seq.cached = seq.computed = min(shared, len(seq.prompt) - 1)  # at least one token to prefill
        self.metrics.cached_prompt_tokens_total += seq.cached
        self.running[seq.request_id] = seq
        self.prefilling.append(seq)

    async def _prefill_chunk(self, seq: Sequence) -> None:
        start = seq.computed
        chunk = seq.prompt[start : start + self.prefill_chunk]
        last = start + len(chunk) == len(seq.prompt)
        sampled = await self.runner.ask(
            lambda r: PrefillStep(request_id=seq.request_id, row=seq.row, token_ids=chunk, start=start, last=last,
                                  params=seq.params, reply=r)
        )
        seq.computed += len(chunk)
        if last:
            self.prefilling.popleft()
            self.metrics.observe_ttft(time.perf_counter() - seq.submitted)
            await self._emit(seq, sampled)

    async def _decode(self, batch: list[Sequence]) -> None:
        started = time.perf_counter()
        sampled = await self.runner.ask(
            lambda r: DecodeStep(
                request_ids=[s.request_id for s in batch],
                rows=[s.row for s in batch],
                tokens=[s.output[-1] for s in batch],
                positions=[s.last_position for s in batch],
                steps=[len(s.output) for s in batch],
                params=[s.params for s in batch],
                reply=r,
            )
        )
        self.metrics.observe_decode(time.perf_counter() - started, len(batch))
        for seq, one in zip(batch, sampled, strict=True):
            await self._emit(seq, one)

    async def _emit(self, seq: Sequence, sampled: Sampled) -> None:
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

    async def _retire(self, seq: Sequence) -> None:
        self.running.pop(seq.request_id, None)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
            self.row_tokens[seq.row] = seq.prompt[: seq.computed]
        else:
            self.row_tokens[seq.row] = seq.in_kv
        self.free_rows[seq.row] = time.perf_counter()
        self.metrics.requests_finished_total += 1
        seq.outbox.close()
        await self.runner.send(Release(seq.request_id))
