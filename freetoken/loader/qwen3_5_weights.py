"""The hybrid Qwen families' layer tensors (qwen3_next, qwen3_5_moe): Gated DeltaNet layers and
gated full attention, read into models/weights.py's layout, and qwen3_5_moe's text model read
from under `model.language_model.` by the names a text-only checkpoint gives it.

Shape legend: H hidden, HK/HV linear key/value heads, DK/DV their dims, r = HV/HK, W conv width,
Hq/Hkv attention heads, D head dim.

Both families store the same linear layer two ways. qwen3_5 splits the input projection:
in_proj_qkv (q, k and v of every head in turn), in_proj_z, in_proj_b, in_proj_a. qwen3_next
fuses it by key head: in_proj_qkvz [HK, (DK, DK, r*DV, r*DV)] and in_proj_ba [HK, (r, r)]; its
rows are reordered here into qwen3_5's layout, which is what the block computes with. The
reordering is a permutation of rows, so the block's numbers are the checkpoint's.
"""

from __future__ import annotations

import logging

import torch

from freetoken.config import ModelConfig
from freetoken.models.family import layer_prefix
from freetoken.models.weights import AttentionWeights, LinearAttentionWeights

log = logging.getLogger(__name__)

TEXT_MODEL = "model.language_model."  # qwen3_5_moe's text model, beside model.visual.* and mtp.*
SKIPPED = ("model.visual.", "mtp.")  # the vision tower and the multi-token-prediction head


class TextModelReader:
    """A vision-language checkpoint's text model read as a text-only one: `model.X` is read from
    `model.language_model.X` (lm_head stays where it is). Errors name the stored tensor."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.file_of = {self._text_name(n): f for n, f in inner.file_of.items() if not n.startswith(SKIPPED)}
        self.skipped = {prefix: sum(n.startswith(prefix) for n in inner.file_of) for prefix in SKIPPED}

    @staticmethod
    def _text_name(stored: str) -> str:
        return "model." + stored[len(TEXT_MODEL):] if stored.startswith(TEXT_MODEL) else stored

    @staticmethod
    def _stored(name: str) -> str:
        return TEXT_MODEL + name[len("model."):] if name.startswith("model.") else name

    def has(self, name: str) -> bool:
        return self.inner.has(self._stored(name))

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.inner.get(self._stored(name), shape, dtype)

    def optional(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        return self.get(name, shape, dtype) if self.has(name) else None

    def stored_dtype(self, name: str) -> torch.dtype | None:
        return self.inner.stored_dtype(self._stored(name))

    def log_skipped(self) -> None:
        vision, mtp = (self.skipped[p] for p in SKIPPED)
        log.info("qwen3_5_moe: reading the text model (model.language_model.*); skipped %d vision tower tensors "
                 "(model.visual.*) and %d multi-token-prediction tensors (mtp.*)", vision, mtp)


def text_model_reader(reader):
    """`reader` as a TextModelReader when its checkpoint keeps the text model under
    model.language_model. (qwen3_5_moe), else `reader` itself."""
    if reader.has(TEXT_MODEL + "embed_tokens.weight") and not reader.has("model.embed_tokens.weight"):
        return TextModelReader(reader)
    return reader


def is_linear_layer(cfg: ModelConfig, layer: int) -> bool:
    return bool(cfg.layer_types) and cfg.layer_types[layer] == "linear_attention"


def linear_attention_weights(r, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> LinearAttentionWeights:
    la, H = cfg.linear_attention, cfg.hidden_size
    HK, HV, DK, DV, W = la.key_heads, la.value_heads, la.key_dim, la.value_dim, la.conv_width
    C = la.conv_channels
    p = f"{layer_prefix(layer)}linear_attn."
    if r.has(p + "in_proj_qkvz.weight"):  # qwen3_next: grouped by key head
        ratio = HV // HK
        qkvz = r.get(p + "in_proj_qkvz.weight", (2 * HK * DK + 2 * HV * DV, H), dtype)
        q, k, v, z = qkvz.view(HK, -1, H).split([DK, DK, ratio * DV, ratio * DV], dim=1)
        qkv = torch.cat([t.reshape(-1, H) for t in (q, k, v)])
        b, a = r.get(p + "in_proj_ba.weight", (2 * HV, H), dtype).view(HK, 2 * ratio, H).split([ratio, ratio], dim=1)
        z, b, a = (t.reshape(-1, H).contiguous() for t in (z, b, a))
    else:
        qkv = r.get(p + "in_proj_qkv.weight", (C, H), dtype)
        z = r.get(p + "in_proj_z.weight", (HV * DV, H), dtype)
        b = r.get(p + "in_proj_b.weight", (HV, H), dtype)
        a = r.get(p + "in_proj_a.weight", (HV, H), dtype)
    return LinearAttentionWeights(
        qkv=qkv, z=z, b=b, a=a,
        conv=r.get(p + "conv1d.weight", (C, 1, W), dtype).view(C, W),
        # the decay's parameters stay fp32 whatever the compute dtype (its exp would lose the rate)
        A_log=r.get(p + "A_log", (HV,), torch.float32),
        dt_bias=r.get(p + "dt_bias", (HV,), torch.float32),
        norm=r.get(p + "norm.weight", (DV,), dtype),
        out=r.get(p + "out_proj.weight", (H, HV * DV), dtype),
    )


def gated_attention_weights(r, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> AttentionWeights:
    """q_proj gives each head its query and then its gate ([Hq, 2D] rows): split into wq and wgate."""
    p = f"{layer_prefix(layer)}self_attn."
    H, D, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    wq, wgate = r.get(p + "q_proj.weight", (hq * 2 * D, H), dtype).view(hq, 2 * D, H).split([D, D], dim=1)
    attn = AttentionWeights(
        wq=wq.reshape(hq * D, H).contiguous(), wgate=wgate.reshape(hq * D, H).contiguous(),
        wk=r.get(p + "k_proj.weight", (hkv * D, H), dtype),
        wv=r.get(p + "v_proj.weight", (hkv * D, H), dtype),
        wo=r.get(p + "o_proj.weight", (H, hq * D), dtype),
        q_norm=r.get(p + "q_norm.weight", (D,), dtype),
        k_norm=r.get(p + "k_norm.weight", (D,), dtype),
    )
    if cfg.qkv_bias:  # attention_bias: every projection biased, the gate's half of q_proj's too
        bq, bgate = r.get(p + "q_proj.bias", (hq * 2 * D,), dtype).view(hq, 2 * D).split([D, D], dim=1)
        attn.bq, attn.bgate = bq.reshape(-1).contiguous(), bgate.reshape(-1).contiguous()
        attn.bk = r.get(p + "k_proj.bias", (hkv * D,), dtype)
        attn.bv = r.get(p + "v_proj.bias", (hkv * D,), dtype)
        attn.bo = r.get(p + "o_proj.bias", (H,), dtype)
    return attn
