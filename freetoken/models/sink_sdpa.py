"""gpt-oss's attention with sinks through SDPA's fused kernels, for long prefill chunks.

The reference (reference/sink_attention.py) rounds where transformers' eager forward rounds, and
so materialises every score: at an 8192-token chunk that is Hq * T * Lk = 4.3G scores a layer at
gpt-oss's 64 heads, written and read again by each of its ~10 torch ops. Here the sink becomes one
more key, and the whole softmax runs inside one fused SDPA kernel (fp32 sums, nothing
materialised):

    q' = [q, sink_h / scale, 0...]   k'_j = [k_j, 0, 0...]   k'_sink = [0, 1, 0...]   v'_sink = 0

so q'.k'_j = q.k_j for every real key, and q'.k'_sink * scale = sink_h for every query of head h:
the sink's logit joins each row's softmax and its zero value adds nothing to the output, which is
the sink's definition. The head dim grows by one (padded to a multiple of 8, as the fused kernels
want) and the keys by the sink and masked padding to a multiple of 16 (the memory-efficient
kernel's mask alignment). Keys and values are repeated to the query heads (grouped heads would
send SDPA to its unfused math path). Queries go in slices of bounded scores, as the reference's do.

Numerics: the fused kernels sum in fp32 and round once, where the reference rounds the scores, the
scaled scores, the max-subtracted scores and the probabilities to the activation dtype; the two
agree within the activation dtype's rounding of the result (tests/test_sink_sdpa.py in fp32 and
bf16). Decode and short chunks keep the reference, whose greedy tokens match transformers' eager
forward in bf16 (tests/gpu/test_bf16_parity.py).

Shape legend: B sequences, Hq/Hkv heads, T queries, Lk keys, D head dim, E = D + 1 and L = Lk + 1 padded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Chunks of at least this many queries take the fused path (models/attention.py): below it the
# eager scores are small, and short prompts keep transformers' rounding points.
MIN_QUERIES = 256
# Queries per SDPA call, so that a call's scores [B, Hq, t, L] stay near this many elements should
# SDPA ever run them on its unfused math path (which holds them all, in fp32): 1 GB.
SLICE_SCORES = 1 << 28


def sink_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
              sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, T, D], keys/values [B, Hkv, Lk, D], mask [B, 1, T, Lk] (True: attended), sinks [Hq]
    -> [B, Hq, T, D] in q's dtype: `reference.sink_attention`'s contract."""
    B, Hq, T, D = q.shape
    Lk, groups = keys.shape[2], Hq // keys.shape[1]
    E = -(-(D + 1) // 8) * 8
    L = -(-(Lk + 1) // 16) * 16  # keys, the sink, then masked padding: the mask's rows 16-aligned
    qx = q.new_zeros(B, Hq, T, E)
    qx[..., :D] = q
    qx[..., D] = (sinks.float() / scale).to(q.dtype)[None, :, None]
    kx = keys.new_zeros(B, Hq, L, E)
    kx[:, :, :Lk, :D] = keys.repeat_interleave(groups, dim=1)
    kx[:, :, Lk, D] = 1
    vx = values.new_zeros(B, Hq, L, E)
    vx[:, :, :Lk, :D] = values.repeat_interleave(groups, dim=1)
    mx = torch.zeros(B, 1, T, L, dtype=torch.bool, device=mask.device)
    mx[..., :Lk] = mask
    mx[..., Lk] = True
    out = q.new_empty(B, Hq, T, D)
    step = max(1, SLICE_SCORES // (B * Hq * L))
    for t in range(0, T, step):
        out[:, :, t : t + step] = F.scaled_dot_product_attention(
            qx[:, :, t : t + step], kx, vx, attn_mask=mx[:, :, t : t + step], scale=scale)[..., :D]
    return out
