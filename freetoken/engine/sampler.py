"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Shape legend: B sequences in the step, V vocab.

Each seeded request owns a torch.Generator so its samples do not depend on what else is in
the batch; unseeded requests draw from one engine-wide generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.config import SamplingParams
from freetoken.engine.protocol import TokenLogprob


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
    def __init__(self, device: str, seed: int = 0) -> None:
        self.device = device
        self.shared = torch.Generator(device=device)
        self.shared.manual_seed(seed)

    def generator_for(self, params: SamplingParams) -> torch.Generator | None:
        if params.greedy or params.seed is None:
            return None
        gen = torch.Generator(device=self.device)
        gen.manual_seed(params.seed)
        return gen

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> list[Sampled]:
        """logits [B, V] -> one token per sequence (with its logprobs when asked for)."""
        logits = logits.float()
        if all(p.greedy for p in params):
            tokens = logits.argmax(dim=-1).tolist()
        else:
            tokens = []
            for row, p, gen in zip(logits, params, generators, strict=True):
                if p.greedy:
                    tokens.append(int(row.argmax()))
                    continue
                probs = torch.softmax(filter_logits(row / p.temperature, p.top_k, p.top_p), dim=-1)
                ok = bool(torch.isfinite(probs).all())
                tokens.append(int(torch.multinomial(probs, 1, generator=gen or self.shared)) if ok else -1)
        return [
            Sampled(-1, error="the model produced non-finite logits; no token could be sampled")
            if tok < 0
            else Sampled(tok, _logprob(row, tok, p.logprobs) if p.logprobs is not None else None)
            for row, tok, p in zip(logits, tokens, params, strict=True)
        ]


def _logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """Log-softmax of the raw logits (before temperature and filters), as OpenAI reports them."""
    logp = torch.log_softmax(logits, dim=-1)  # [V]
    best = torch.topk(logp, top) if top else None
    alternatives = list(zip(best.indices.tolist(), best.values.tolist(), strict=True)) if best is not None else []
    return TokenLogprob(token_id=token, logprob=float(logp[token]), top=alternatives)
