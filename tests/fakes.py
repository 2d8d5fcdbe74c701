"""A fake tokenizer and a fake LLM implementing the engine protocol, for testing front ends
without a model.

FakeTokenizer: one token per UTF-8 byte (ids 0-255) plus EOS (256) and BOS (257); the chat
template is plain text and, like real ones, rejects a system message that is not first.

TemplateTokenizer: the same tokens with a real chat template, for a family's end-to-end tests.

FakeLLM: answers every prompt with REPLY (then EOS); at temperature > 0 the reply is rotated by
an amount drawn from the seed. It honours max_tokens, stop strings (never released, like the
engine's), stop_token_ids and ignore_eos, and emits one chunk per token. Markers in the prompt
text change its behaviour:

    [[slow]]     20 ms per token          [[forever]]  never emits EOS (runs to max_tokens)
    [[error]]    an error chunk after 3   [[raise]]    raises EngineError after 3 tokens
    [[reject]]   raises RequestError before the first chunk
    [[cache]]    reports as cached the prompt prefix shared with an earlier [[cache]] prompt

`llm.script(marker, reply, ...)` scripts the replies to prompts containing `marker` (one per
request, in order; REPLY once they run out), e.g. to make the model call a tool. Chunks carry
logprobs when asked for (made-up but consistent numbers: the sampled token first in `top`).
`arch` picks the output parsers the server uses (a model family, as ModelConfig.arch).

Every request is recorded in `llm.requests` (FakeRequest), including whether its iterator was
closed before it finished (`cancelled`); `done` is a threading.Event, so a test in another
thread can wait for it.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio

from freetoken.config import SamplingParams
from freetoken.engine.protocol import CompletionChunk, TokenLogprob
from freetoken.errors import EngineError, RequestError
from freetoken.loader.tokenizer import _compile_template

REPLY = "Hello from the fake engine! The quick brown fox jumps over the lazy dog. Ünïcödé ✓ done."


class FakeTokenizer:
    eos_token_id = 256
    bos_token_id = 257
    vocab_size = 258

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.eos_token_id,)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str | None:
        # Bytes that are not ASCII are spelled as SentencePiece's byte-fallback tokens.
        if token_id >= 256:
            return None
        return chr(token_id) if token_id < 128 else f"<0x{token_id:02X}>"

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs,
    ) -> str:
        """Plain-text turns; tool calls and tool-call ids are rendered as JSON, and
        enable_thinking=True opens a <think> block in the generation prompt."""
        out = []
        if tools:
            out.append(f"<|tools|>{json.dumps(tools, sort_keys=True)}<|end|>\n")
        for i, msg in enumerate(messages):
            if msg["role"] == "system" and i != 0:
                raise RequestError("chat template: the system message must be at the beginning")
            extra = ""
            if msg.get("tool_calls"):
                extra += f"<|calls|>{json.dumps(msg['tool_calls'], sort_keys=True)}"
            if msg.get("tool_call_id"):
                extra += f"<|id|>{msg['tool_call_id']}"
            out.append(f"<|{msg['role']}|>{msg['content']}{extra}<|end|>\n")
        if add_generation_prompt:
            out.append("<|assistant|>")
            if kwargs.get("enable_thinking"):
                out.append("<think>\n")
        return "".join(out)



class TemplateTokenizer(FakeTokenizer):
    """The fake's byte tokens, with a real chat template (loader/chat_templates.py) rendered
    as the engine's tokenizer renders it."""

    def __init__(self, chat_template: str) -> None:
        self.chat_template = chat_template

    def apply_chat_template(self, messages, *, add_generation_prompt=True, tools=None, **kwargs) -> str:
        return _compile_template(self.chat_template).render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
        )

def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _logprob(token: int, step: int, top_n: int) -> TokenLogprob:
    """Made-up logprobs: the sampled token is the most likely, alternatives follow it."""
    logprob = -0.125 * ((token + step) % 7) - 0.01
    top = [((token + k) % 256, logprob - k) for k in range(top_n)]
    return TokenLogprob(token_id=token, logprob=logprob, top=top)


@dataclass
class FakeRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str
    reply: str | None = None  # scripted
    cached_tokens: int = 0
    finished: bool = False
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class FakeLLM:
    def __init__(self, model_name: str = "fake-model", max_model_len: int = 512, arch: str = "qwen3_moe") -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.arch = arch
        self.tokenizer = FakeTokenizer()
        self.requests: list[FakeRequest] = []
        self._scripts: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def script(self, marker: str, *replies: str) -> None:
        """Answer the next prompts containing `marker` with `replies`, in order."""
        with self._lock:
            self._scripts.setdefault(marker, []).extend(replies)

    def request(self, request_id: str) -> FakeRequest:
        with self._lock:
            return next(r for r in self.requests if r.request_id == request_id)

    def find(self, marker: str) -> list[FakeRequest]:
        """The recorded requests whose prompt contains `marker`."""
        with self._lock:
            return [r for r in self.requests if marker in r.prompt_text]

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[CompletionChunk]:
        params.validate()
        if not prompt_token_ids:
            raise RequestError("the prompt is empty", param="prompt")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt of {len(prompt_token_ids)} tokens exceeds max_model_len", param="prompt"
            )
        rec = FakeRequest(request_id, list(prompt_token_ids), params, self.tokenizer.decode(prompt_token_ids))
        with self._lock:
            if "[[cache]]" in rec.prompt_text:
                earlier = (r.prompt_ids for r in self.requests if "[[cache]]" in r.prompt_text)
                rec.cached_tokens = max((_shared(ids, rec.prompt_ids) for ids in earlier), default=0)
                rec.cached_tokens = min(rec.cached_tokens, len(rec.prompt_ids) - 1)
            marker = next((m for m, replies in self._scripts.items() if replies and m in rec.prompt_text), None)
            rec.reply = self._scripts[marker].pop(0) if marker is not None else None
            self.requests.append(rec)
        return self._run(rec)

    def _reply_ids(self, params: SamplingParams, scripted: str | None = None) -> list[int]:
        if scripted is not None:
            return self.tokenizer.encode(scripted)
        text = REPLY
        if not params.greedy:
            k = random.Random(params.seed).randrange(len(text))
            text = text[k:] + text[:k]
        return self.tokenizer.encode(text)

    async def _run(self, rec: FakeRequest) -> AsyncIterator[CompletionChunk]:
        params, prompt = rec.params, rec.prompt_text
        tok = self.tokenizer
        try:
            if "[[reject]]" in prompt:
                raise RequestError("the fake engine rejects this prompt", param="prompt")
            reply = self._reply_ids(params, rec.reply)
            forever = "[[forever]]" in prompt
            stops = params.stop
            hold = max((len(s) for s in stops), default=1) - 1
            ids: list[int] = []
            released = 0
            n = 0
            text = ""
            while True:
                await anyio.sleep(0.02 if "[[slow]]" in prompt else 0)
                if n == 3 and "[[error]]" in prompt:
                    rec.finished = True
                    yield self._chunk(rec, "", [], n, "error", error="fake failure")
                    return
                if n == 3 and "[[raise]]" in prompt:
                    raise EngineError("fake crash")
                if n < len(reply) or forever:
                    token = reply[n % len(reply)]
                else:
                    token = tok.eos_token_id
                n += 1
                finish = None
                if (token in tok.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
                    finish = "stop"
                else:
                    ids.append(token)
                decoded = tok.decode(ids)
                out = ""
                if not decoded.endswith("\ufffd"):
                    text = decoded
                    cut = min(
                        (i for s in stops if (i := text.find(s, max(0, released - hold))) >= 0), default=-1
                    )
                    if cut >= 0:
                        finish = "stop"
                        upto = cut
                    else:
                        upto = len(text) if finish else len(text) - hold
                    if upto > released:
                        out, released = text[released:upto], upto
                elif finish and len(text) > released:
                    out, released = text[released:], len(text)
                if finish is None and n >= params.max_tokens:
                    finish = "length"
                    out += text[released:]
                    released = len(text)
                rec.finished = finish is not None
                yield self._chunk(rec, out, [token], n, finish)
                if finish:
                    return
        except (GeneratorExit, anyio.get_cancelled_exc_class()):
            rec.cancelled = not rec.finished  # closed (or cancelled) before its last chunk
            raise
        finally:
            rec.done.set()

    @staticmethod
    def _chunk(rec, text, token_ids, n, finish, error=None) -> CompletionChunk:
        return CompletionChunk(
            text=text,
            token_ids=token_ids,
            finish_reason=finish,
            prompt_tokens=len(rec.prompt_ids),
            completion_tokens=n,
            error=error,
            cached_tokens=rec.cached_tokens,
            logprobs=None if rec.params.logprobs is None else [_logprob(t, n, rec.params.logprobs) for t in token_ids],
        )

    # ------------------------------------------------------------------ caches and metrics
    # A pretend memory split for the operator routes: `cache_bytes` shared by expert slots
    # (`slot_bytes` each, at most `experts`) and KV tokens (`kv_token_bytes` each, at least
    # max_model_len). An impossible resize raises RequestError and changes nothing.
    experts = 64
    moe_slots = 16
    kv_tokens = 8192
    cache_bytes = 64 << 20
    slot_bytes = 1 << 20
    kv_token_bytes = 4 << 10

    async def cache_status(self) -> dict:
        await anyio.sleep(0)
        return {
            "policy": "hybrid",
            "experts": self.experts,
            "expert_slots": self.moe_slots,
            "kv_tokens": self.kv_tokens,
            "expert_slot_bytes": self.moe_slots * self.slot_bytes,
            "kv_bytes": self.kv_tokens * self.kv_token_bytes,
            "budget_bytes": self.cache_bytes,
            "hit_rate": 0.75,
        }

    async def resize_cache(self, moe_slots: int | None, kv_tokens: int | None) -> dict:
        slots = self.moe_slots if moe_slots is None else moe_slots
        kv = self.kv_tokens if kv_tokens is None else kv_tokens
        if slots > self.experts:
            raise RequestError(f"{slots} expert slots is more than the model's {self.experts} experts", "moe_slots")
        if kv < self.max_model_len:
            raise RequestError(f"{kv} KV tokens cannot hold one {self.max_model_len}-token sequence", "kv_tokens")
        need = slots * self.slot_bytes + kv * self.kv_token_bytes
        if need > self.cache_bytes:
            raise RequestError(f"{slots} expert slots and {kv} KV tokens need {need} bytes; {self.cache_bytes} fit")
        self.moe_slots, self.kv_tokens = slots, kv
        return await self.cache_status()

    def recent_spans(self, limit: int) -> list[dict]:
        return []  # a fake engine does not trace

    def health(self) -> dict:
        """The shape of AsyncLLM.health (a fake engine never fails; tests replace this to make it)."""
        with self._lock:
            running = sum(not r.finished for r in self.requests)
        return {"status": "ok", "model": self.model_name, "arch": self.arch, "device": "cpu", "ready": True,
                "requests": {"running": running, "waiting": 0}, "expert_slots": self.moe_slots}

    def metrics(self) -> dict:
        with self._lock:
            reqs = list(self.requests)
        n = len(reqs)
        return {
            "counters": {
                "requests_total": n,
                "requests_finished_total": sum(r.finished for r in reqs),
                "requests_failed_total": 0,
                "prompt_tokens_total": sum(len(r.prompt_ids) for r in reqs),
                "cached_prompt_tokens_total": 0,
                "generation_tokens_total": 0,
                "experts_fetched_total": 0,
                "pcie_bytes_total": 0,
                "prefill_stream_pcie_bytes_total": 0,
                "cpu_expert_routes_total": 0,
            },
            "gauges": {
                "running_requests": sum(not r.done.is_set() for r in reqs),
                "waiting_requests": 0,
                "decode_tokens_per_second": 0.0,
                "expert_cache_hit_rate": 0.75,
                "expert_slots": self.moe_slots,
                "kv_tokens": self.kv_tokens,
            },
            "histograms": {
                "time_to_first_token_seconds": {
                    "buckets": [(0.01, n // 2), (0.1, n), (1.0, n), (float("inf"), n)],
                    "sum": 0.02 * n,
                    "count": n,
                },
            },
            "help": {"requests_total": "Requests the fake engine received."},
        }
