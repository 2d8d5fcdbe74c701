"""Qwen3-MoE: q and k RMS-normed per head before the rotary; biases on q/k/v/o with attention_bias."""

from __future__ import annotations

from freetoken.models.attention import Attention
from freetoken.models.family import Family
from freetoken.models.weights import AttentionWeights


class HeadNormAttention(Attention):
    """q/k RMSNorm over each head's D values, after the head split (the fused decode kernel does
    the same, given the norm weights)."""

    def project_qkv(self, a: AttentionWeights, x):
        q, k, v = super().project_qkv(a, x)
        eps = self.cfg.rms_norm_eps
        return self.ops.rms_norm(q, a.q_norm, eps), self.ops.rms_norm(k, a.k_norm, eps), v


QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"),
                   attention=HeadNormAttention)
