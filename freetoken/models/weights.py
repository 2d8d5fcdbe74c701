"""The model's weights as plain tensors, in the layout the engine computes with.

Shape legend: V vocab, H hidden, L layers, E experts, I expert intermediate, F dense/shared
intermediate, Hq query heads, Hkv key/value heads, D head dim.

Experts are held per layer as two banks, whatever the checkpoint's layout:
  w13 [E, 2I, H]  gate rows 0..I-1, then up rows I..2I-1 (one GEMM gives both halves)
  w2  [E, H, I]   down projection
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionWeights:
    wq: torch.Tensor  # [Hq*D, H]
    wk: torch.Tensor  # [Hkv*D, H]
    wv: torch.Tensor  # [Hkv*D, H]
    wo: torch.Tensor  # [H, Hq*D]
    bq: torch.Tensor | None = None  # [Hq*D]   (qwen2_moe)
    bk: torch.Tensor | None = None  # [Hkv*D]
    bv: torch.Tensor | None = None  # [Hkv*D]
    bo: torch.Tensor | None = None  # [H]      (qwen3_moe, olmoe with attention_bias)
    q_norm: torch.Tensor | None = None  # [D] (qwen3_moe) or [Hq*D] (olmoe)
    k_norm: torch.Tensor | None = None  # [D] or [Hkv*D]
    sinks: torch.Tensor | None = None  # [Hq] (gpt_oss): each head's logit that joins its softmax
    wgate: torch.Tensor | None = None  # [Hq*D, H] (qwen3_next, qwen3_5): each head's sigmoid gate on its output
    bgate: torch.Tensor | None = None  # [Hq*D] (with attention_bias)
    # The three projections as one ((Hq + 2*Hkv)*D rows; wq/wk/wv/bq/bk/bv are then views of it),
    # set by `fuse_qkv` for the fused decode path: one GEMM instead of three.
    wqkv: torch.Tensor | None = None  # [(Hq+2Hkv)*D, H]
    bqkv: torch.Tensor | None = None  # [(Hq+2Hkv)*D]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor once (views of the fused projection are not counted again)."""
        fused = ("wq", "wk", "wv", "bq", "bk", "bv") if self.wqkv is not None else ()
        return [t for name, t in vars(self).items() if t is not None and name not in fused]

    def fuse_qkv(self) -> None:
        """Store q/k/v as one projection (the separate ones become row views of it, so the
        reference path computes exactly what it did)."""
        if self.wqkv is not None:
            return
        self.wqkv = torch.cat([self.wq, self.wk, self.wv])
        rows = [self.wq.shape[0], self.wk.shape[0], self.wv.shape[0]]
        self.wq, self.wk, self.wv = self.wqkv.split(rows)
        if self.bq is not None:
            self.bqkv = torch.cat([self.bq, self.bk, self.bv])
            self.bq, self.bk, self.bv = self.bqkv.split(rows)


@dataclass
class LinearAttentionWeights:
    """A Gated DeltaNet layer (models/gated_deltanet.py). HK/HV key/value heads of DK/DV,
    C = 2*HK*DK + HV*DV conv channels (q, k, then v), W conv width."""

    qkv: torch.Tensor  # [C, H]: q, k, v before the conv
    z: torch.Tensor  # [HV*DV, H]: the output norm's gate
    b: torch.Tensor  # [HV, H]: beta's logit
    a: torch.Tensor  # [HV, H]: the decay's input
    conv: torch.Tensor  # [C, W]: the depthwise causal conv
    A_log: torch.Tensor  # [HV]: log of the decay rate
    dt_bias: torch.Tensor  # [HV]
    norm: torch.Tensor  # [DV]: the gated RMSNorm's weight (not zero-centred)
    out: torch.Tensor  # [H, HV*DV]
    in_proj: torch.Tensor | None = None  # [C + HV*DV + 2*HV, H]: qkv, z, b and a as one projection (fuse_in_proj)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor once (views of the fused projection are not counted again)."""
        fused = ("qkv", "z", "b", "a") if self.in_proj is not None else ()
        return [t for name, t in vars(self).items() if t is not None and name not in fused]

    def fuse_in_proj(self) -> None:
        """Store the four projections of the layer's input as one (a decode step's one GEMV instead
        of four); the separate ones become row views of it, so every path computes what it did."""
        if self.in_proj is not None:
            return
        self.in_proj = torch.cat([self.qkv, self.z, self.b, self.a])
        self.qkv, self.z, self.b, self.a = self.in_proj.split([t.shape[0] for t in (self.qkv, self.z, self.b, self.a)])


@dataclass
class DenseMLPWeights:
    gate: torch.Tensor  # [F, H]
    up: torch.Tensor  # [F, H]
    down: torch.Tensor  # [H, F]


@dataclass
class MoEWeights:
    router: torch.Tensor  # [E, H]
    router_bias: torch.Tensor | None = None  # [E] (gpt_oss)
    # Expert banks when the model holds its own experts; None when the host pool owns them
    # (the engine: experts live in freetoken/cache/, and reach the device through the slot cache).
    w13: torch.Tensor | None = None  # [E, 2I, H]
    w2: torch.Tensor | None = None  # [E, H, I]
    shared: DenseMLPWeights | None = None  # qwen2_moe shared expert
    shared_gate: torch.Tensor | None = None  # [1, H]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    post_attention_norm: torch.Tensor  # [H]
    attn: AttentionWeights | LinearAttentionWeights
    mlp: MoEWeights | DenseMLPWeights


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] (the embedding itself when tied)

    def step_read_bytes(self) -> int:
        """Bytes of these weights one forward reads whatever its token count: every tensor but the
        embedding table, of which it gathers only its tokens' rows (tied to the head, the head
        reads it whole, and it is counted). A floor's on-device part, and prefill's matmul size."""
        untied = self.lm_head is not self.embed
        return sum(t.nbytes for t in self.tensors()) - (self.embed.nbytes if untied else 0)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor once, for moving or counting bytes."""
        out = [self.embed, self.final_norm]
        if self.lm_head is not self.embed:
            out.append(self.lm_head)
        for layer in self.layers:
            out += [layer.input_norm, layer.post_attention_norm]
            out += layer.attn.tensors()
            mlp = layer.mlp
            if isinstance(mlp, MoEWeights):
                out += [t for t in (mlp.router, mlp.router_bias, mlp.w13, mlp.w2) if t is not None]
                if mlp.shared is not None:
                    out += list(vars(mlp.shared).values()) + [mlp.shared_gate]
            else:
                out += list(vars(mlp).values())
        return out
