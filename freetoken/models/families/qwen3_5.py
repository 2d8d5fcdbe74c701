"""Qwen3-Next and Qwen3.5-MoE: three of every four layers are Gated DeltaNet linear attention
(models/gated_deltanet.py), the fourth gated full attention; the MoE layer adds Qwen2-MoE's
sigmoid-gated shared expert; every RMSNorm but the DeltaNet's output norm stores its weight
zero-centred (the model's ops take the (1 + w) norms: reference/norms.py).

Gated attention: q_proj gives each head a query and a gate (split at load, loader/qwen3_5_weights.py),
q and k are RMS-normed per head, the rotary turns only the first `partial_rotary_factor` of each
head's dims, and the attention's output is multiplied by sigmoid(gate) before o_proj. Only these
layers hold KV pages: the KV pool indexes them in order (models/layer_kinds.py).

qwen3_5_moe is the vision-language checkpoint: its text model is the same decoder, read from
under model.language_model.*. Its rotary is multimodal (mrope), whose three position streams
are equal for text, which makes it the plain rotary used here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.config import ModelConfig
from freetoken.models.families.qwen2_moe import SharedExpertMoELayer
from freetoken.models.families.qwen3_moe import HeadNormAttention
from freetoken.models.family import Family
from freetoken.models.gated_deltanet import GatedDeltaNet
from freetoken.models.kv_cache import KVView
from freetoken.models.layer_kinds import attention_layers
from freetoken.models.ops import DenseOps
from freetoken.models.weights import AttentionWeights


class GatedAttention(HeadNormAttention):
    # The fused decode layer (norms inside the projections, models/transformer.py) does not know
    # this family's zero-centred norms; a one-token step's attention itself still runs through
    # the fused decode kernels (`decode_one_token`).
    supports_fused_decode = False

    def __init__(self, config: ModelConfig, ops: DenseOps) -> None:
        super().__init__(config, ops)
        self.rotary_dim = int(config.head_dim * config.partial_rotary_factor)
        self.kv_index = {layer: i for i, layer in enumerate(attention_layers(config))}  # layer -> KV pool layer

    def rotate(self, x: torch.Tensor, cos_sin) -> torch.Tensor:
        """x [B, T, heads, D]: the rotary over the first rotary_dim dims (cos/sin are that wide)."""
        turned, kept = x[..., :self.rotary_dim].contiguous(), x[..., self.rotary_dim:]
        return torch.cat([self.ops.rotate(turned, *cos_sin), kept], dim=-1)

    def __call__(self, layer: int, a: AttentionWeights, x: torch.Tensor, cos_sin, kv: KVView,
                 positions: torch.Tensor, key_len: int) -> torch.Tensor:
        if x.shape[1] == 1 and self.ops.decode is not None:
            return self.decode_one_token(layer, a, x, cos_sin, kv, positions)
        q, k, v = self.project_qkv(a, x)
        q, k = self.rotate(q, cos_sin), self.rotate(k, cos_sin)
        out = self.attend(self.kv_index[layer], q, k, v, kv, positions, key_len)  # [B, T, Hq*D]
        return F.linear(out * torch.sigmoid(F.linear(x, a.wgate, a.bgate)), a.wo, a.bo)

    def decode_one_token(self, layer: int, a: AttentionWeights, x: torch.Tensor, cos_sin, kv: KVView,
                         positions: torch.Tensor) -> torch.Tensor:
        """`__call__` for one token per sequence, x [B, 1, H] -> [B, 1, H], through the fused
        decode kernels: the q/k/v and gate projections, one kernel for the zero-centred q/k norms,
        the partial rotary and the pool write, attention over the pool, the gate, o_proj. (The
        reference path's q/k norms, two rotaries with their slices and concatenations, pool
        copies, gathers and masked attention over the padded key bucket were some twenty
        launches, and its attention grew with the bucket, not the sequence.)"""
        cfg, decode = self.cfg, self.ops.decode
        if a.wqkv is None:
            raise ValueError("fused decode attention needs the fused q/k/v projection (AttentionWeights.fuse_qkv)")
        B = x.shape[0]
        x2 = x.reshape(B, -1)
        cos, sin = (t.reshape(B, -1) for t in cos_sin)  # [B, rotary_dim]
        pool_layer = self.kv_index[layer]
        k_pool, v_pool = kv.cache.k[pool_layer], kv.cache.v[pool_layer]
        qkv = decode.project(x2, a.wqkv, a.bqkv)
        q = decode.qkv_prep(qkv, cfg.num_heads, cfg.num_kv_heads, a.q_norm, a.k_norm, cfg.rms_norm_eps, cos, sin,
                            kv.write_index, k_pool, v_pool, rotary_dim=self.rotary_dim,
                            offset_norm=cfg.zero_centred_norms)
        out = decode.attend(q, k_pool, v_pool, kv.read_index, positions)  # [B, Hq*D]
        gated = out * torch.sigmoid(decode.project(x2, a.wgate, a.bgate))
        return decode.project(gated, a.wo, a.bo).view(B, 1, -1)


def _family(arch: str, hf_architecture: str) -> Family:
    return Family(arch, hf_architecture, "mlp", ("gate_proj", "up_proj", "down_proj"), attention=GatedAttention,
                  moe_layer=SharedExpertMoELayer, linear_attention=GatedDeltaNet)


QWEN3_NEXT = _family("qwen3_next", "Qwen3NextForCausalLM")
QWEN3_5_MOE_TEXT = _family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")
QWEN3_5_MOE = _family("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration")
