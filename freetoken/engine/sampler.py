"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Shape legend: B sequences in the step, V vocab.

Each sampled request owns a torch.Generator so its samples do not depend on what else is in
the batch: seeded from the request's seed (which reproduces), else from OS entropy (so an
unseeded request differs from one start of the engine to the next).

A row of logits with a NaN or an infinity is the model's failure (corrupt weights, overflow),
on every path, greedy included: argmax over NaNs would pick a token with no meaning. That
sequence gets an error; the others in the batch are sampled as usual.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from freetoken.config import SamplingParams
from freetoken.engine.protocol import TokenLogprob

NON_FINITE_LOGITS = "the model produced non-finite logits (NaN or infinity); no token could be sampled"


def entropy_seed() -> int:
    """A seed for torch.Generator from the OS's entropy (the range manual_seed takes)."""
    return secrets.randbits(64)


@dataclass
class Sampled:
    token: int
    logprob: TokenLogprob | None = None  # when the request asked for logprobs
    error: str | None = None  # this sequence could not be sampled (token is -1); the others were


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] (already divided by temperature) -> logits with excluded tokens at -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop_sorted[0] = False  # the most likely token stays, however small top_p is
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    def __init__(self, device: str, seed: int | None = None) -> None:
        """`seed` seeds the generator that rows passed without one of their own draw from
        (None: OS entropy)."""
        self.device = device
        self.shared = torch.Generator(device=device)
        self.shared.manual_seed(entropy_seed() if seed is None else seed)

    def generator_for(self, params: SamplingParams) -> torch.Generator | None:
        if params.greedy:
            return None
        gen = torch.Generator(device=self.device)
        gen.manual_seed(entropy_seed() if params.seed is None else params.seed)
        return gen

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> list[Sampled]:
        """logits [B, V] -> one token per sequence (with its logprobs when asked for); a sequence
        whose logits are not all finite gets token -1 and an error."""
        logits = logits.float()
        finite = torch.isfinite(logits).all(dim=-1)  # [B]
        if all(p.greedy for p in params):  # one transfer from the device for the whole batch
            tokens = torch.where(finite, logits.argmax(dim=-1), -1).tolist()
        else:
            tokens = [
                (self._sample_row(row, p, gen) if not p.greedy else int(row.argmax())) if ok else -1
                for row, p, gen, ok in zip(logits, params, generators, finite.tolist(), strict=True)
            ]
        return [
            Sampled(-1, error=NON_FINITE_LOGITS)
            if tok < 0
            else Sampled(tok, _logprob(row, tok, p.logprobs) if p.logprobs is not None else None)
            for row, tok, p in zip(logits, tokens, params, strict=True)
        ]

    def _sample_row(self, row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
        """One sequence's token from finite logits [V]; -1 when dividing by the temperature overflowed."""
        probs = torch.softmax(filter_logits(row / p.temperature, p.top_k, p.top_p), dim=-1)
        if not bool(torch.isfinite(probs).all()):
            return -1
        return int(torch.multinomial(probs, 1, generator=gen or self.shared))


def _logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """Log-softmax of the raw logits (before temperature and filters), as OpenAI reports them."""
    logp = torch.log_softmax(logits, dim=-1)  # [V]
    best = torch.topk(logp, top) if top else None
    alternatives = list(zip(best.indices.tolist(), best.values.tolist(), strict=True)) if best is not None else []
    return TokenLogprob(token_id=token, logprob=float(logp[token]), top=alternatives)
