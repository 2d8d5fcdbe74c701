"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Shape legend: B sequences in the step, V vocab.

Each seeded request owns a torch.Generator so its samples do not depend on what else is in
the batch; unseeded requests draw from one engine-wide generator.
"""

from __future__ import annotations

import torch

from freetoken.config import SamplingParams


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
    ) -> list[int]:
        """logits [B, V] -> one token id per sequence."""
        logits = logits.float()
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1).tolist()
        out = []
        for row, p, gen in zip(logits, params, generators, strict=True):
            if p.greedy:
                out.append(int(row.argmax()))
                continue
            probs = torch.softmax(filter_logits(row / p.temperature, p.top_k, p.top_p), dim=-1)
            out.append(int(torch.multinomial(probs, 1, generator=gen or self.shared)))
        return out
