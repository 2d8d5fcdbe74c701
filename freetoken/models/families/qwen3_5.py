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
    # The fused decode kernels know neither the output gate nor a partial rotary (a later step).
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
        q, k, v = self.project_qkv(a, x)
        q, k = self.rotate(q, cos_sin), self.rotate(k, cos_sin)
        out = self.attend(self.kv_index[layer], q, k, v, kv, positions, key_len)  # [B, T, Hq*D]
        return F.linear(out * torch.sigmoid(F.linear(x, a.wgate, a.bgate)), a.wo, a.bo)


def _family(arch: str, hf_architecture: str) -> Family:
    return Family(arch, hf_architecture, "mlp", ("gate_proj", "up_proj", "down_proj"), attention=GatedAttention,
                  moe_layer=SharedExpertMoELayer, linear_attention=GatedDeltaNet)


QWEN3_NEXT = _family("qwen3_next", "Qwen3NextForCausalLM")
QWEN3_5_MOE_TEXT = _family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")
QWEN3_5_MOE = _family("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration")
