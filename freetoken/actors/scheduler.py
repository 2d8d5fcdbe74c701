"""Scheduler: requests in, batched steps out, chunks back to each request's outbox.

Plain Python over ints and deques. Each step admits at most one waiting request (its prompt
runs as one prefill) and then decodes every running sequence together, so a long prompt
delays running streams by one prefill, not by its whole generation. Sequences hold a KV row
from admission to finish.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import anyio

from freetoken.actors.messages import DecodeStep, PrefillStep, Release, Submit, Tick
from freetoken.actors.runtime import Actor, Outbox, handles
from freetoken.config import SamplingParams
from freetoken.engine.detokenizer import Decoder, IncrementalText
from freetoken.engine.protocol import CompletionChunk, FinishReason


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    outbox: Outbox
    text: IncrementalText
    stop_ids: frozenset[int]
    row: int = -1
    output: list[int] = field(default_factory=list)

    @property
    def last_position(self) -> int:
        """Where the newest token sits (it is fed back at this position)."""
        return len(self.prompt) + len(self.output) - 1


class Scheduler(Actor):
    def __init__(
        self, runner: Actor, decoder: Decoder, eos_ids: tuple[int, ...], rows: int, max_len: int
    ) -> None:
        super().__init__("scheduler", mailbox_size=1024)
        self.runner = runner
        self.decoder = decoder
        self.eos_ids = frozenset(eos_ids)
        self.max_len = max_len
        self.free_rows = list(range(rows))[::-1]
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}
        self._tick_pending = False

    # -- messages -----------------------------------------------------------------------------
    @handles(Submit)
    async def submit(self, msg: Submit) -> None:
        p = msg.params
        stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_ids)
        self.waiting.append(
            Sequence(msg.request_id, msg.prompt_token_ids, p, msg.outbox, IncrementalText(self.decoder, p.stop), stop_ids)
        )
        self._kick()

    @handles(Tick)
    async def tick(self, msg: Tick) -> None:
        self._tick_pending = False
        await self._step()
        if self.waiting or self.running:
            self._kick()

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
        while self.waiting and self.waiting[0].outbox.consumer_gone:
            self.waiting.popleft()
        if self.waiting and self.free_rows:
            seq = self.waiting.popleft()
            seq.row = self.free_rows.pop()
            self.running[seq.request_id] = seq
            token = await self.runner.ask(
                lambda r: PrefillStep(request_id=seq.request_id, row=seq.row, token_ids=seq.prompt, params=seq.params, reply=r)
            )
            await self._emit(seq, token)
            return
        batch = list(self.running.values())
        if not batch:
            return
        tokens = await self.runner.ask(
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
        for seq, token in zip(batch, tokens, strict=True):
            await self._emit(seq, token)

    async def _emit(self, seq: Sequence, token: int) -> None:
        seq.output.append(token)
        finish: FinishReason | None = None
        text = ""
        if token in seq.stop_ids:
            finish = "stop"
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
        )
        delivered = seq.outbox.put(chunk)  # False: the client went away
        if finish is not None or not delivered:
            await self._retire(seq)

    async def _retire(self, seq: Sequence) -> None:
        self.running.pop(seq.request_id, None)
        self.free_rows.append(seq.row)
        seq.outbox.close()
        await self.runner.send(Release(seq.request_id))
