"""The Gated DeltaNet linear-attention block of qwen3_next and qwen3_5: what those families' linear
layers compute in place of attention, over the recurrent-state pool (models/recurrent_state.py).

Shape legend: B sequences, T new tokens per sequence, H hidden, HK/HV key/value heads, DK/DV
their dims, r = HV/HK, C = 2*HK*DK + HV*DV conv channels.

Per layer: q, k, v come out of one projection and a depthwise causal conv with SiLU (whose last
W-1 inputs per sequence are state); beta = sigmoid(b), the log decay g = -exp(A_log) *
softplus(a + dt_bias); each key head's q and k serve its r value heads; the gated delta rule
(reference/gated_delta.py) runs over each sequence's state; the result is RMS-normed per value
head, gated by silu(z), and projected out. A prefill chunk or a decode step starts from the state
the sequence's previous step left in its slot, so chunks and steps continue one another. A read-only
row (a captured step's padding, slot -(s + 1)) starts from slot s and writes nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.config import ModelConfig
from freetoken.models.kv_cache import KVView
from freetoken.models.layer_kinds import linear_layers
from freetoken.models.ops import DenseOps
from freetoken.models.weights import LinearAttentionWeights


class GatedDeltaNet:
    def __init__(self, config: ModelConfig, ops: DenseOps) -> None:
        self.shape = config.linear_attention
        self.eps = config.rms_norm_eps
        self.ops = ops
        self.state_index = {layer: i for i, layer in enumerate(linear_layers(config))}  # layer -> state pool row

    def __call__(self, layer: int, w: LinearAttentionWeights, x: torch.Tensor, kv: KVView) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]; updates the state of each row's slot (kv.state_slots)."""
        if kv.states is None:
            raise ValueError("a linear-attention layer needs the step's recurrent-state slots (KVView.attach_states)")
        s, ops = self.shape, self.ops
        B, T, _ = x.shape
        index, slots = self.state_index[layer], kv.state_slots
        if w.in_proj is not None:  # one projection, split (views)
            qkv, z, b, a = F.linear(x, w.in_proj).split([t.shape[0] for t in (w.qkv, w.z, w.b, w.a)], -1)
        else:
            qkv, z, b, a = (F.linear(x, t) for t in (w.qkv, w.z, w.b, w.a))
        mixed = ops.causal_conv(qkv, w.conv, kv.states.conv[index], slots)  # [B, T, C]
        q, k, v = mixed.split([s.key_heads * s.key_dim, s.key_heads * s.key_dim, s.value_heads * s.value_dim], -1)
        # [B, T, HK, DK]: key head h serves value heads h*r .. h*r + r-1 (the delta rule maps them)
        q, k = q.reshape(B, T, s.key_heads, s.key_dim), k.reshape(B, T, s.key_heads, s.key_dim)
        g, beta = ops.delta_gates(b, a, w.A_log, w.dt_bias)  # [B, T, HV]: the log decay (fp32), beta
        out = ops.gated_delta(q, k, v.reshape(B, T, s.value_heads, s.value_dim), g, beta,
                              kv.states.ssm[index], slots)  # [B, T, HV, DV]
        z = z.reshape(B, T, s.value_heads, s.value_dim)
        out = ops.gated_rms_norm(out, z, w.norm, self.eps)
        out = F.linear(out.reshape(B, T, -1), w.out)
        # a captured step's padding rows read row 0's slot before or after row 0 wrote it: they
        # take row 0's output, so that they go on computing (and routing) exactly as row 0 does
        return out if kv.state_rows is None else out.index_select(0, kv.state_rows)
