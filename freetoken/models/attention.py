"""Grouped-query self-attention with rotary embeddings over the paged KV cache: the block every
family shares. A family that norms or clips q/k/v subclasses `project_qkv` in its own file.
Options the config turns on (gpt_oss): a sliding window on the layers `sliding_layers` names, and
attention sinks (a learned logit per head that joins each softmax and adds nothing to the output).

Shape legend: B sequences, T new tokens per sequence, H hidden, Hq/Hkv heads, D head dim,
Lk attended key length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from freetoken.config import ModelConfig
from freetoken.models import sink_sdpa
from freetoken.models.kv_cache import KVView
from freetoken.models.ops import DenseOps
from freetoken.models.weights import AttentionWeights
from freetoken.reference.sink_attention import sink_attention

CosSin = tuple[torch.Tensor, torch.Tensor]


class Attention:
    # Whether one-token steps may take the fused decode kernels, which apply only per-head q/k
    # norms (given the norm weights) to the fused q/k/v projection.
    supports_fused_decode = True

    def __init__(self, config: ModelConfig, ops: DenseOps) -> None:
        self.cfg = config
        self.ops = ops
        self.fused_decode = ops.decode is not None and self.supports_fused_decode
        self.windows = [config.sliding_window if sliding else None for sliding in config.sliding_layers]

    def linear_qkv(self, a: AttentionWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> q [B, T, Hq*D], k and v [B, T, Hkv*D] (biased where the weights have biases)."""
        return F.linear(x, a.wq, a.bq), F.linear(x, a.wk, a.bk), F.linear(x, a.wv, a.bv)

    def split_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """q [B, T, Hq*D], k/v [B, T, Hkv*D] -> q [B, T, Hq, D], k/v [B, T, Hkv, D]."""
        cfg = self.cfg
        B, T, _ = q.shape
        D = cfg.head_dim
        return q.view(B, T, cfg.num_heads, D), k.view(B, T, cfg.num_kv_heads, D), v.view(B, T, cfg.num_kv_heads, D)

    def project_qkv(self, a: AttentionWeights, x: torch.Tensor):
        """x [B, T, H] -> q [B, T, Hq, D], k/v [B, T, Hkv, D], before the rotary."""
        return self.split_heads(*self.linear_qkv(a, x))

    def __call__(
        self, layer: int, a: AttentionWeights, x: torch.Tensor, cos_sin: CosSin, kv: KVView, positions: torch.Tensor,
        key_len: int,
    ) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]. key_len: keys each row attends over (its last position + 1,
        the largest in the batch); given by the caller, which knows it without reading the device."""
        q, k, v = self.project_qkv(a, x)
        q, k = self.ops.rotate(q, *cos_sin), self.ops.rotate(k, *cos_sin)
        return F.linear(self.attend(layer, q, k, v, kv, positions, key_len, a.sinks), a.wo, a.bo)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVView,
               positions: torch.Tensor, key_len: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, T, Hq, D], k/v [B, T, Hkv, D] after the rotary -> [B, T, Hq*D], before the output
        projection: the new keys written into the pool's `layer`, then attention over the pool
        (sinks [Hq]: gpt_oss's)."""
        B, T = q.shape[:2]
        kv.write(layer, k, v)
        keys, values = kv.read(layer)  # [B, Lk, Hkv, D]
        q = q.transpose(1, 2)  # [B, Hq, T, D]
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, Lk, D]
        window = self.windows[layer] if self.windows else None
        if window is not None or sinks is not None:
            long = self.ops.long_sink_attention if T >= sink_sdpa.MIN_QUERIES else None
            out = windowed_attention(q, keys, values, positions, key_len, window, sinks, kv.padded,
                                     long or sink_attention)
        elif B == 1 and T == key_len and not kv.padded:  # a whole prompt from position 0: plain causal
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=T > 1, enable_gqa=True)
        elif B == 1 and T == 1 and not kv.padded:  # one token sees every cached key
            out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        elif B == 1 and not kv.padded:  # a prompt chunk after cached keys: causal, aligned to the last key
            # (no [T, Lk] mask is built: at 8k-token chunks over 32k keys that mask is 256 MB a layer)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(T, key_len),
                                                 enable_gqa=True)
        else:
            key_pos = torch.arange(key_len, device=q.device)
            mask = key_pos[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, Lk]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(B, T, -1)  # [B, T, Hq*D]

    def decode_from_qkv(self, layer: int, a: AttentionWeights, qkv: torch.Tensor, cos_sin: CosSin, kv: KVView,
                        positions: torch.Tensor) -> torch.Tensor:
        """One token per sequence through the fused decode kernels, from its q/k/v projection
        [B, (Hq + 2*Hkv) * D] -> [B, 1, H]: one kernel for the q/k norms, rotary and the pool
        write, one (or two) for attention over the pool, then the output projection."""
        cfg, decode = self.cfg, self.ops.decode
        B = qkv.shape[0]
        cos, sin = (t.view(B, -1) for t in cos_sin)  # [B, D]
        k_pool, v_pool = kv.cache.k[layer], kv.cache.v[layer]  # [P*Z, Hkv, D]
        q = decode.qkv_prep(qkv, cfg.num_heads, cfg.num_kv_heads, a.q_norm, a.k_norm, cfg.rms_norm_eps, cos, sin,
                            kv.write_index, k_pool, v_pool)  # [B, Hq, D]
        out = decode.attend(q, k_pool, v_pool, kv.read_index, positions)  # [B, Hq*D]
        return decode.project(out, a.wo, a.bo).view(B, 1, -1)


def windowed_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                       key_len: int, window: int | None, sinks: torch.Tensor | None, padded: bool,
                       with_sinks=sink_attention) -> torch.Tensor:
    """Causal attention where a query at position p sees the keys at positions p - window + 1 .. p
    (every earlier key when window is None), and each head's sink joins its softmax (computed by
    `with_sinks`: the reference, or models/sink_sdpa.py for long chunks).
    q [B, Hq, T, D], keys/values [B, Hkv, Lk, D], positions [B, T], sinks [Hq] -> [B, Hq, T, D]."""
    B, Hq, T, D = q.shape
    first = 0
    if window is not None and B == 1 and not padded:
        # the chunk's first query (position key_len - T) sees no key before this one
        first = max(0, key_len - T - window + 1)
        keys, values = keys[:, :, first:], values[:, :, first:]
    key_pos = torch.arange(first, key_len, device=q.device)
    query_pos = positions[:, None, :, None]  # [B, 1, T, 1]
    mask = key_pos <= query_pos  # [B, 1, T, Lk]
    if window is not None:
        mask &= key_pos > query_pos - window
    if sinks is not None:  # (gpt_oss: transformers' eager rounding points, as its checkpoints run there)
        return with_sinks(q, keys, values, mask, sinks, D**-0.5)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
