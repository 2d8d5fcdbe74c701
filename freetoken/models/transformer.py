"""The pre-norm MoE decoder, composed of the blocks its family names (models/families/).

Shape legend: B sequences, T new tokens per sequence, N = B*T, H hidden, V vocab.

Each layer: RMSNorm, attention, residual add; RMSNorm, MoE layer (or a dense MLP), residual add.
The MoE layer is a seam: the router computes the routing, and a MoE backend decides where
experts run. What the blocks compute with is one `DenseOps` bundle (models/ops.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.config import ModelConfig
from freetoken.models.families import family_of
from freetoken.models.kv_cache import KVView
from freetoken.models.mlp import swiglu
from freetoken.models.moe_layer import MoEBackend
from freetoken.models.ops import REFERENCE_OPS, DenseOps, with_family_norms
from freetoken.models.weights import LayerWeights, LinearAttentionWeights, ModelWeights, MoEWeights
from freetoken.reference.rotary import Rotary


def fused_decode_supported(config: ModelConfig) -> bool:
    """Whether one-token steps can take the fused decode kernels: a family whose attention norms
    q/k over the whole projection (before the head split) keeps the reference path."""
    return family_of(config).attention.supports_fused_decode


class MoETransformer:
    def __init__(
        self, config: ModelConfig, weights: ModelWeights, backend: MoEBackend, device: str,
        ops: DenseOps = REFERENCE_OPS,
    ) -> None:
        """ops: REFERENCE_OPS, or `fused_ops()` (the engine's on CUDA). With `ops.decode`, one-token
        steps run through the fused decode kernels (they need the fused q/k/v projection,
        `AttentionWeights.fuse_qkv`), with the input norm inside the q/k/v projection and the
        post-attention add and norm inside the router's linear layer; other steps, and families
        `fused_decode_supported` turns away, take the path of every other step."""
        family = family_of(config)
        # zero-centred: every norm, the attention's q/k norms too, scales by (1 + w)
        ops = with_family_norms(ops, config.zero_centred_norms, family.norms_rounded_once)
        self.cfg = config
        self.w = weights
        self.ops = ops
        self.backend = backend
        self.attention = family.attention(config, ops)
        self.linear_attention = family.linear_attention(config, ops) if family.linear_attention else None
        self.moe = family.moe_layer(family.router(config, ops), backend)
        self.fused_decode = self.attention.fused_decode
        if self.fused_decode and any(layer.attn.wqkv is None for layer in weights.layers):
            raise ValueError("fused decode attention needs the fused q/k/v projection (AttentionWeights.fuse_qkv)")
        if self.fused_decode and config.router_bias:  # its router kernel computes unbiased logits
            raise ValueError("fused decode steps do not know the router's bias")
        rotary_dim = int(config.head_dim * config.partial_rotary_factor)  # (the first dims of each head)
        self.rotary = Rotary(rotary_dim, config.rope_theta, device, config.rope_scaling)

    @property
    def routing_hook(self):
        """Optional (layer, logits, weights, ids) -> (weights, ids): routing record/replay."""
        return self.moe.routing_hook

    @routing_hook.setter
    def routing_hook(self, hook) -> None:
        self.moe.routing_hook = hook

    def layer(
        self, i: int, lw: LayerWeights, h: torch.Tensor, delta: torch.Tensor | None, cos_sin, kv: KVView, positions,
        key_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the residual stream before layer i, still missing `delta` (what layer i-1's MLP
        adds; None before the first layer) -> (h, delta) for the next layer. Each add is done
        together with the norm that reads its sum."""
        if h.shape[1] == 1 and self.fused_decode:
            return self._fused_decode_layer(i, lw, h, delta, cos_sin, kv, positions)
        ops, eps = self.ops, self.cfg.rms_norm_eps
        if delta is None:
            attn_in = ops.rms_norm(h, lw.input_norm, eps)
        else:
            h, attn_in = ops.add_rms_norm(h, delta, lw.input_norm, eps)
        if isinstance(lw.attn, LinearAttentionWeights):
            mixed = self.linear_attention(i, lw.attn, attn_in, kv)
        else:
            mixed = self.attention(i, lw.attn, attn_in, cos_sin, kv, positions, key_len)
        h, x = ops.add_rms_norm(h, mixed, lw.post_attention_norm, eps)
        mlp = self.moe(i, lw.mlp, x) if isinstance(lw.mlp, MoEWeights) else swiglu(x, lw.mlp)
        return h, mlp

    def _fused_decode_layer(self, i: int, lw: LayerWeights, h: torch.Tensor, delta: torch.Tensor | None, cos_sin,
                            kv: KVView, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer` for one token per sequence with the norms inside the kernels after them:
        the input norm in the q/k/v projection, the post-attention add and norm in the router's
        linear layer."""
        decode, eps, a = self.ops.decode, self.cfg.rms_norm_eps, lw.attn
        h, qkv = decode.norm_project(h, delta, lw.input_norm, eps, a.wqkv, a.bqkv)
        attn = self.attention.decode_from_qkv(i, a, qkv, cos_sin, kv, positions)
        if not isinstance(lw.mlp, MoEWeights):
            h, x = self.ops.add_rms_norm(h, attn, lw.post_attention_norm, eps)
            return h, swiglu(x, lw.mlp)
        h, x, logits = decode.norm_router(h, attn, lw.post_attention_norm, eps, lw.mlp.router)
        shape = x.shape
        return h, self.moe.from_logits(i, lw.mlp, x.reshape(-1, shape[-1]), logits).view(shape)

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
        h = embed(tokens, self.w.embed)  # [B, T, H]
        delta = None
        cos_sin = self.rotary.cos_sin(positions, h.dtype)
        for i, lw in enumerate(self.w.layers):
            h, delta = self.layer(i, lw, h, delta, cos_sin, kv, positions, key_len)
        if last_only:
            h, delta = h[:, -1], delta[:, -1]  # [B, H]
        h = self.ops.add_rms_norm(h, delta, self.w.final_norm, self.cfg.rms_norm_eps)[1]
        return F.linear(h, self.w.lm_head)  # [B, V] or [B, T, V]


def embed(tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The token embedding wherever its table lies: torch's lookup where the table is on the
    tokens' device; where it stays in pinned host memory (model_runner), the gather kernel that
    reads its rows over the bus (kernels/triton/host_embedding.py, imported only then)."""
    if table.device == tokens.device:
        return F.embedding(tokens, table)
    if table.device.type == "cpu" and tokens.is_cuda:
        from freetoken.kernels.triton.host_embedding import gather_rows

        return gather_rows(tokens, table)
    raise ValueError(f"embedding table on {table.device}, token ids on {tokens.device}: no path between them")
