"""The decoder shared by all supported MoE families, written as the reference semantics.

Shape legend: B sequences, T new tokens per sequence, N = B*T, H hidden, Hq/Hkv heads,
D head dim, K top-k, V vocab, Lk attended key length.

Family differences are data in ModelConfig (q/k norm kind, qkv bias, router renormalisation
and precision, shared expert). The MoE layer is a seam: the decoder computes router logits
and top-k, then hands (hidden, weights, ids) to a MoE backend, which decides where experts run.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from freetoken.config import ModelConfig
from freetoken.models.kv_cache import KVView
from freetoken.models.weights import AttentionWeights, DenseMLPWeights, LayerWeights, ModelWeights, MoEWeights
from freetoken.reference.moe import route
from freetoken.reference.norms import add_rms_norm, rms_norm
from freetoken.reference.rotary import Rotary


class MoEBackend(Protocol):
    def experts(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [N, H], weights/ids [N, K] -> weighted expert sum [N, H]."""
        ...


def swiglu(x: torch.Tensor, mlp: DenseMLPWeights) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, mlp.gate)) * F.linear(x, mlp.up), mlp.down)


def fused_decode_supported(config: ModelConfig) -> bool:
    """Whether one-token steps can take the fused decode attention: models that clip q/k/v or
    norm q/k over the whole projection (before the head split) keep the reference path."""
    return config.clip_qkv is None and config.qk_norm != "full"


class MoETransformer:
    def __init__(
        self, config: ModelConfig, weights: ModelWeights, backend: MoEBackend, device: str, norm=rms_norm,
        rotate=Rotary.apply, add_norm=add_rms_norm, router=route, router_linear=F.linear, fused_decode: bool = False,
        project=F.linear, norm_project=None, norm_router=None,
    ) -> None:
        """norm, rotate, add_norm, router, router_linear: implementations of `rms_norm`,
        `Rotary.apply`, `add_rms_norm`, `reference.moe.route` and `F.linear` for the router's
        logits (the engine passes fused kernels on CUDA, each paired with its twin in
        kernels/specs/dense.py). fused_decode: one-token steps run attention
        through kernels/triton/decode_attention.py (needs the fused q/k/v projection,
        `AttentionWeights.fuse_qkv`); other steps, and models `fused_decode_supported` turns
        away, take the reference path. project: `F.linear` for the attention's projections in
        those fused one-token steps. norm_project, norm_router (kernels/triton/norm_linear.py;
        None: the separate ops above): in those steps, the input norm with the q/k/v projection,
        and the post-attention add and norm with the router's logits, each one call."""
        self.cfg = config
        self.w = weights
        self.backend = backend
        self.norm = norm
        self.rotate = rotate
        self.add_norm = add_norm
        self.router = router
        self.router_linear = router_linear
        self.project = project
        self.norm_project, self.norm_router = norm_project, norm_router
        self.fused_decode = fused_decode and fused_decode_supported(config)
        if self.fused_decode:
            from freetoken.kernels.triton.decode_attention import decode_attention, qkv_prep

            self._decode_attention, self._qkv_prep = decode_attention, qkv_prep
            if any(layer.attn.wqkv is None for layer in weights.layers):
                raise ValueError("fused decode attention needs the fused q/k/v projection (AttentionWeights.fuse_qkv)")
        # Optional (layer, logits, weights, ids) -> (weights, ids): routing record/replay.
        self.routing_hook = None
        self.rotary = Rotary(config.head_dim, config.rope_theta, device)

    def attention(
        self,
        layer: int,
        a: AttentionWeights,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv: KVView,
        positions: torch.Tensor,
        key_len: int,
    ) -> torch.Tensor:
        """key_len: keys each row attends over (its last position + 1, the largest in the batch);
        given by the caller, which knows it without reading the device."""
        cfg = self.cfg
        B, T, _ = x.shape
        if T == 1 and self.fused_decode:
            qkv = self.project(x.view(B, -1), a.wqkv, a.bqkv)  # [B, (Hq + 2*Hkv) * D]
            return self._fused_decode_attention(layer, a, qkv, cos_sin, kv, positions)
        D, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        q = F.linear(x, a.wq, a.bq)  # [B, T, Hq*D]
        k = F.linear(x, a.wk, a.bk)  # [B, T, Hkv*D]
        v = F.linear(x, a.wv, a.bv)  # [B, T, Hkv*D]
        if cfg.qk_norm == "full":  # OLMoE: over the whole projection, before the head split
            q = self.norm(q, a.q_norm, cfg.rms_norm_eps)
            k = self.norm(k, a.k_norm, cfg.rms_norm_eps)
        if cfg.clip_qkv is not None:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q, k, v = q.view(B, T, hq, D), k.view(B, T, hkv, D), v.view(B, T, hkv, D)
        if cfg.qk_norm == "head":  # Qwen3: per head
            q = self.norm(q, a.q_norm, cfg.rms_norm_eps)
            k = self.norm(k, a.k_norm, cfg.rms_norm_eps)
        q, k = self.rotate(q, *cos_sin), self.rotate(k, *cos_sin)
        kv.write(layer, k, v)
        keys, values = kv.read(layer)  # [B, Lk, Hkv, D]
        q = q.transpose(1, 2)  # [B, Hq, T, D]
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, Lk, D]
        if B == 1 and T == key_len and not kv.padded:  # a whole prompt from position 0: plain causal
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=T > 1, enable_gqa=True)
        elif B == 1 and T == 1 and not kv.padded:  # one token sees every cached key
            out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        elif B == 1 and not kv.padded:  # a prompt chunk after cached keys: causal, aligned to the last key
            # (no [T, Lk] mask is built: at 8k-token chunks over 32k keys that mask is 256 MB a layer)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(T, key_len),
                                                 enable_gqa=True)
        else:
            key_pos = torch.arange(key_len, device=x.device)
            mask = key_pos[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, Lk]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        out = out.transpose(1, 2).reshape(B, T, hq * D)  # [B, T, Hq*D]
        return F.linear(out, a.wo, a.bo)

    def _fused_decode_attention(self, layer: int, a: AttentionWeights, qkv: torch.Tensor, cos_sin,
                                kv: KVView, positions: torch.Tensor) -> torch.Tensor:
        """One token per sequence, from its q/k/v projection [B, (Hq + 2*Hkv) * D]: one kernel for
        the q/k norms, rotary and the pool write, one (or two) for attention over the pool, then
        the output projection."""
        cfg = self.cfg
        B = qkv.shape[0]
        cos, sin = (t.view(B, -1) for t in cos_sin)  # [B, D]
        k_pool, v_pool = kv.cache.k[layer], kv.cache.v[layer]  # [P*Z, Hkv, D]
        q = self._qkv_prep(qkv, cfg.num_heads, cfg.num_kv_heads, a.q_norm, a.k_norm, cfg.rms_norm_eps, cos, sin,
                           kv.write_index, k_pool, v_pool)  # [B, Hq, D]
        out = self._decode_attention(q, k_pool, v_pool, kv.read_index, positions)  # [B, Hq*D]
        return self.project(out, a.wo, a.bo).view(B, 1, -1)

    def moe(self, layer: int, m: MoEWeights, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, H]
        logits = self.router_linear(x, m.router)  # [N, E]
        weights, ids = self.router(logits, cfg.top_k, cfg.norm_topk_prob, cfg.router_weights_fp32)
        return self._routed_experts(layer, m, x, logits, weights, ids).view(shape)

    def _routed_experts(self, layer: int, m: MoEWeights, x: torch.Tensor, logits: torch.Tensor,
                        weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [N, H] and its routing -> the MoE block's output [N, H] (shared experts included)."""
        if self.routing_hook is not None:
            weights, ids = self.routing_hook(layer, logits, weights, ids)
        out = self.backend.experts(layer, x, weights, ids)  # [N, H]
        if m.shared is not None:
            out = out + torch.sigmoid(F.linear(x, m.shared_gate)) * swiglu(x, m.shared)
        return out

    def layer(
        self, i: int, lw: LayerWeights, h: torch.Tensor, delta: torch.Tensor | None, cos_sin, kv: KVView, positions,
        key_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the residual stream before layer i, still missing `delta` (what layer i-1's MLP
        adds; None before the first layer) -> (h, delta) for the next layer. Each add is done
        together with the norm that reads its sum."""
        eps = self.cfg.rms_norm_eps
        if h.shape[1] == 1 and self.fused_decode and None not in (self.norm_project, self.norm_router):
            return self._fused_decode_layer(i, lw, h, delta, cos_sin, kv, positions)
        if delta is None:
            attn_in = self.norm(h, lw.input_norm, eps)
        else:
            h, attn_in = self.add_norm(h, delta, lw.input_norm, eps)
        h, x = self.add_norm(h, self.attention(i, lw.attn, attn_in, cos_sin, kv, positions, key_len),
                             lw.post_attention_norm, eps)
        mlp = self.moe(i, lw.mlp, x) if isinstance(lw.mlp, MoEWeights) else swiglu(x, lw.mlp)
        return h, mlp

    def _fused_decode_layer(self, i: int, lw: LayerWeights, h: torch.Tensor, delta: torch.Tensor | None, cos_sin,
                            kv: KVView, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer` for one token per sequence with the norms inside the kernels after them:
        the input norm in the q/k/v projection, the post-attention add and norm in the router's
        linear layer."""
        cfg, eps, a = self.cfg, self.cfg.rms_norm_eps, lw.attn
        h, qkv = self.norm_project(h, delta, lw.input_norm, eps, a.wqkv, a.bqkv)
        attn = self._fused_decode_attention(i, a, qkv, cos_sin, kv, positions)
        if not isinstance(lw.mlp, MoEWeights):
            h, x = self.add_norm(h, attn, lw.post_attention_norm, eps)
            return h, swiglu(x, lw.mlp)
        h, x, logits = self.norm_router(h, attn, lw.post_attention_norm, eps, lw.mlp.router)
        weights, ids = self.router(logits, cfg.top_k, cfg.norm_topk_prob, cfg.router_weights_fp32)
        shape = x.shape
        return h, self._routed_experts(i, lw.mlp, x.reshape(-1, shape[-1]), logits, weights, ids).view(shape)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv: KVView,
        key_len: int,
        last_only: bool = True,
    ) -> torch.Tensor:
        """tokens/positions [B, T] -> logits [B, V] (last token) or [B, T, V]. kv: where this
        step's keys go and come from; key_len: the largest position + 1."""
        h = F.embedding(tokens, self.w.embed)  # [B, T, H]
        delta = None
        cos_sin = self.rotary.cos_sin(positions, h.dtype)
        for i, lw in enumerate(self.w.layers):
            h, delta = self.layer(i, lw, h, delta, cos_sin, kv, positions, key_len)
        if last_only:
            h, delta = h[:, -1], delta[:, -1]  # [B, H]
        h = self.add_norm(h, delta, self.w.final_norm, self.cfg.rms_norm_eps)[1]
        return F.linear(h, self.w.lm_head)  # [B, V] or [B, T, V]
