"""gpt-oss's attention with sinks, rounded where transformers' eager gpt-oss attention rounds, so
that bf16 runs choose its greedy tokens (its checkpoints have no SDPA or flash path there).

Each head's sink is one more logit in each query's softmax, with no value. In the activation
dtype, in this order: the scores q.k (rounded), times the scale (rounded); masked keys set to
the dtype's lowest value; the sink appended as the last column; the row's max subtracted
(rounded); the softmax (computed in fp32 by torch, rounded); the sink column dropped; the
product with the values (rounded). Exact softmax arithmetic in fp32 as well.

Shape legend: B sequences, Hq/Hkv heads, T queries, Lk keys, D head dim.
"""

from __future__ import annotations

import torch

# Queries per slice, so that a slice's scores [B, Hq, t, Lk] stay near this many elements (a
# long prefill chunk over a long context would otherwise hold every score at once).
SCORE_ELEMENTS = 1 << 26


def sink_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, T, D], keys/values [B, Hkv, Lk, D], mask [B, 1, T, Lk] (True: attended), sinks [Hq]
    -> [B, Hq, T, D]. Queries are taken in slices (each row's arithmetic is the same)."""
    B, Hq, T, _ = q.shape
    groups = Hq // keys.shape[1]
    keys, values = _repeat_heads(keys, groups), _repeat_heads(values, groups)  # [B, Hq, Lk, D]
    step = max(1, SCORE_ELEMENTS // (B * Hq * keys.shape[2]))
    if step >= T:
        return _attend(q, keys, values, mask, sinks, scale)
    return torch.cat([_attend(q[:, :, s:s + step], keys, values, mask[:, :, s:s + step], sinks, scale)
                      for s in range(0, T, step)], dim=2)


def _repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, Lk, D] -> [B, Hkv*groups, Lk, D], each kv head repeated for its query heads."""
    B, Hkv, Lk, D = x.shape
    if groups == 1:
        return x
    return x[:, :, None].expand(B, Hkv, groups, Lk, D).reshape(B, Hkv * groups, Lk, D)


def _attend(q, keys, values, mask, sinks, scale) -> torch.Tensor:
    B, Hq, T, _ = q.shape
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale  # [B, Hq, T, Lk]
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    sink_column = sinks.to(scores.dtype).view(1, Hq, 1, 1).expand(B, Hq, T, 1)
    logits = torch.cat([scores, sink_column], dim=-1)  # [B, Hq, T, Lk+1]
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]  # the sink's share dropped
    return torch.matmul(probs.to(values.dtype), values)
