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
    q_norm: torch.Tensor | None = None  # [D] (qwen3_moe) or [Hq*D] (olmoe)
    k_norm: torch.Tensor | None = None  # [D] or [Hkv*D]


@dataclass
class DenseMLPWeights:
    gate: torch.Tensor  # [F, H]
    up: torch.Tensor  # [F, H]
    down: torch.Tensor  # [H, F]


@dataclass
class MoEWeights:
    router: torch.Tensor  # [E, H]
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
    attn: AttentionWeights
    mlp: MoEWeights | DenseMLPWeights


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] (the embedding itself when tied)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor once, for moving or counting bytes."""
        out = [self.embed, self.final_norm]
        if self.lm_head is not self.embed:
            out.append(self.lm_head)
        for layer in self.layers:
            out += [layer.input_norm, layer.post_attention_norm]
            out += [t for t in vars(layer.attn).values() if t is not None]
            mlp = layer.mlp
            if isinstance(mlp, MoEWeights):
                out += [t for t in (mlp.router, mlp.w13, mlp.w2) if t is not None]
                if mlp.shared is not None:
                    out += list(vars(mlp.shared).values()) + [mlp.shared_gate]
            else:
                out += list(vars(mlp).values())
        return out
