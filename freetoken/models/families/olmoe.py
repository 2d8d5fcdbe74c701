"""OLMoE: q and k RMS-normed over the whole projection (before the head split), then q/k/v
optionally clipped (clip_qkv)."""

from __future__ import annotations

from freetoken.config import ModelConfig
from freetoken.models.attention import Attention
from freetoken.models.family import Family
from freetoken.models.ops import DenseOps
from freetoken.models.weights import AttentionWeights


class FullNormAttention(Attention):
    # The fused decode kernel norms per head only, so one-token steps keep the reference path.
    supports_fused_decode = False

    def __init__(self, config: ModelConfig, ops: DenseOps) -> None:
        super().__init__(config, ops)
        self.clip = config.clip_qkv

    def project_qkv(self, a: AttentionWeights, x):
        q, k, v = self.linear_qkv(a, x)
        eps = self.cfg.rms_norm_eps
        q, k = self.ops.rms_norm(q, a.q_norm, eps), self.ops.rms_norm(k, a.k_norm, eps)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        return self.split_heads(q, k, v)


OLMOE = Family("olmoe", "OlmoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"),
               attention=FullNormAttention)
