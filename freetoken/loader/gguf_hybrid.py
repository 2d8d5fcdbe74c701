"""The hybrid Qwens as llama.cpp's GGUF architectures: `qwen35moe` (qwen3_5_moe, qwen3_5_moe_text)
and `qwen3next` (qwen3_next). Two tables per architecture: the metadata rows llama.cpp's loader
reads (beside the ones every MoE GGUF has, `gguf_writer.Qwen3MoeHyper`), and one row per GGUF
tensor naming the transformers tensor it comes from and the transform that turns one into the other.

Shape legend: H hidden, HK/HV linear key/value heads, DK/DV their dims, r = HV/HK, W conv width,
C = 2*HK*DK + HV*DV conv channels.

The transforms are the ones llama.cpp's own converter applies, so llama.cpp computes what the
checkpoint does:
- zero-centred RMSNorm weights (every norm but the DeltaNet's output norm) are stored as 1 + w;
  we add in fp32 (transformers' norm computes 1 + w in fp32 too), where the converter adds in the
  checkpoint's dtype and would round it;
- `A_log` is stored as the decay rate itself, -exp(A_log); `dt_bias` becomes `ssm_dt.bias`;
- the conv kernel [C, 1, W] loses its middle axis; the shared expert's gate [1, H] becomes [H];
- qwen3next: the fused `in_proj_qkvz` ([HK, (DK, DK, r*DV, r*DV)] rows) becomes `attn_qkv` (every
  head's q, then k, then v) and `attn_gate` (z); `in_proj_ba` is stored as it is;
- qwen35moe: value heads go from grouped by key head (head k*r + j) to tiled (head j*HK + k), so
  ggml can broadcast the key heads instead of repeating them: the v rows of `in_proj_qkv`, the
  rows of `in_proj_z`, `in_proj_b`, `in_proj_a`, `A_log`, `dt_bias`, the conv's v channels and
  the columns of `out_proj`. A permutation: the numbers are the checkpoint's.
llama.cpp's delta-net layers take one head size for keys and values (DK == DV), and its
qwen35moe reads the rotary's multimodal sections, which for text (three equal position streams)
only pick a stream: we write the converter's default [11, 11, 10, 0].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from freetoken.loader.presets import FULL_ATTENTION_INTERVAL, Shape
from freetoken.loader.qwen3_5_fields import LinearAttentionShape

GGUF_ARCHS = {"qwen3_5_moe": "qwen35moe", "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next"}
PRE_TOKENIZERS = {"qwen35moe": "qwen35", "qwen3next": "qwen2"}  # llama.cpp's regex of each family
MROPE_SECTIONS = (11, 11, 10, 0)  # llama.cpp's converter's default for Qwen3.5's rotary

Transform = Callable[[torch.Tensor, LinearAttentionShape], torch.Tensor]


class TensorRow(NamedTuple):
    """One GGUF tensor: its name inside `blk.N.` (or at the top), the transformers tensor inside
    `model.layers.N.` (or the top) it is made from, and the transform between them."""

    gguf: str
    hf: str
    transform: Transform


def metadata_rows(shape: Shape) -> list[tuple[str, Any]]:
    """The `{arch}.` rows beyond the common MoE ones, as llama.cpp's converter writes them."""
    la = _linear_shape(shape)
    rows: list[tuple[str, Any]] = [
        ("expert_shared_feed_forward_length", shape.shared_expert_intermediate_size),
        ("ssm.conv_kernel", la.conv_width),
        ("ssm.state_size", la.key_dim),
        ("ssm.group_count", la.key_heads),
        ("ssm.time_step_rank", la.value_heads),
        ("ssm.inner_size", la.value_heads * la.value_dim),
        ("attention.recurrent_layers", [t == "linear_attention" for t in shape.layer_types]),
        ("full_attention_interval", FULL_ATTENTION_INTERVAL),
        ("rope.dimension_count", int(shape.head_dim * shape.partial_rotary_factor)),
    ]
    if GGUF_ARCHS[shape.arch] == "qwen35moe":
        rows.append(("rope.dimension_sections", list(MROPE_SECTIONS)))
    return rows


def _linear_shape(shape: Shape) -> LinearAttentionShape:
    la = shape.linear_attention
    if shape.arch not in GGUF_ARCHS or la is None:
        raise ValueError(f"arch {shape.arch!r} has no hybrid GGUF layout; expected one of: {', '.join(GGUF_ARCHS)}")
    if la.key_dim != la.value_dim:
        raise ValueError(f"llama.cpp's {GGUF_ARCHS[shape.arch]} takes one head size for the linear layers' "
                         f"keys and values; this shape has key dim {la.key_dim}, value dim {la.value_dim} "
                         "(preset tiny-gguf fits)")
    if not shape.norm_topk_prob:
        raise ValueError(f"llama.cpp's {GGUF_ARCHS[shape.arch]} always renormalises its top-k weights")
    return la


def check_shape(shape: Shape) -> None:
    """ValueError when llama.cpp's architecture cannot hold `shape` (named in the message)."""
    _linear_shape(shape)


# -- transforms (t: the checkpoint's tensor in fp32) -------------------------------------------

def same(t: torch.Tensor, la: LinearAttentionShape) -> torch.Tensor:
    return t


def zero_centred(t: torch.Tensor, la: LinearAttentionShape) -> torch.Tensor:
    return 1.0 + t


def flat(t: torch.Tensor, la: LinearAttentionShape) -> torch.Tensor:
    return t.reshape(-1)


def conv_kernel(t: torch.Tensor, la: LinearAttentionShape) -> torch.Tensor:
    return t.reshape(t.shape[0], t.shape[-1])  # [C, 1, W] -> [C, W]


def decay_rate(t: torch.Tensor, la: LinearAttentionShape) -> torch.Tensor:
    return -t.exp()  # as the block computes it: -exp(A_log) in fp32


def tile_value_heads(t: torch.Tensor, la: LinearAttentionShape, axis: int, head_dim: int) -> torch.Tensor:
    """`axis` of [HV * head_dim] entries from grouped (head k*r + j) to tiled (head j*HK + k) order."""
    r = la.value_heads // la.key_heads
    moved = t.movedim(axis, 0)
    grouped = moved.reshape(la.key_heads, r, head_dim, *moved.shape[1:])
    return grouped.transpose(0, 1).reshape(moved.shape).movedim(0, axis)


def _qk_channels(la: LinearAttentionShape) -> int:
    return 2 * la.key_heads * la.key_dim


def tiled_qkv_rows(t: torch.Tensor, la: LinearAttentionShape) -> torch.Tensor:
    """in_proj_qkv [C, H] or the conv [C, W]: q and k channels kept, v's heads tiled."""
    qk = _qk_channels(la)
    return torch.cat([t[:qk], tile_value_heads(t[qk:], la, 0, la.value_dim)])


def tiled_value_rows(t: torch.Tensor, la: LinearAttentionShape) -> torch.Tensor:
    return tile_value_heads(t, la, 0, la.value_dim)


def tiled_head_rows(t: torch.Tensor, la: LinearAttentionShape) -> torch.Tensor:
    return tile_value_heads(t, la, 0, 1)


def tiled_value_columns(t: torch.Tensor, la: LinearAttentionShape) -> torch.Tensor:
    return tile_value_heads(t, la, 1, la.value_dim)


def tiled_conv_kernel(t: torch.Tensor, la: LinearAttentionShape) -> torch.Tensor:
    return tiled_qkv_rows(conv_kernel(t, la), la)


def tiled_decay_rate(t: torch.Tensor, la: LinearAttentionShape) -> torch.Tensor:
    return tiled_head_rows(decay_rate(t, la), la)


def _qkvz_parts(t: torch.Tensor, la: LinearAttentionShape) -> list[torch.Tensor]:
    r = la.value_heads // la.key_heads
    per_head = t.reshape(la.key_heads, -1, t.shape[-1])
    return [p.reshape(-1, t.shape[-1]) for p in per_head.split([la.key_dim, la.key_dim, r * la.value_dim,
                                                                 r * la.value_dim], dim=1)]


def qkvz_qkv(t: torch.Tensor, la: LinearAttentionShape) -> torch.Tensor:
    q, k, v, _ = _qkvz_parts(t, la)
    return torch.cat([q, k, v])


def qkvz_z(t: torch.Tensor, la: LinearAttentionShape) -> torch.Tensor:
    return _qkvz_parts(t, la)[3]


# -- the tensor tables -----------------------------------------------------------------------

TOP_ROWS = (
    TensorRow("token_embd.weight", "embed_tokens.weight", same),
    TensorRow("output_norm.weight", "norm.weight", zero_centred),
)
LAYER_ROWS = (
    TensorRow("attn_norm.weight", "input_layernorm.weight", zero_centred),
    TensorRow("post_attention_norm.weight", "post_attention_layernorm.weight", zero_centred),
    TensorRow("ffn_gate_inp.weight", "mlp.gate.weight", same),
    TensorRow("ffn_gate_shexp.weight", "mlp.shared_expert.gate_proj.weight", same),
    TensorRow("ffn_up_shexp.weight", "mlp.shared_expert.up_proj.weight", same),
    TensorRow("ffn_down_shexp.weight", "mlp.shared_expert.down_proj.weight", same),
    TensorRow("ffn_gate_inp_shexp.weight", "mlp.shared_expert_gate.weight", flat),
)
# q_proj holds each head's query then its gate; llama.cpp splits it the same way at run time.
ATTENTION_ROWS = (
    TensorRow("attn_q.weight", "self_attn.q_proj.weight", same),
    TensorRow("attn_k.weight", "self_attn.k_proj.weight", same),
    TensorRow("attn_v.weight", "self_attn.v_proj.weight", same),
    TensorRow("attn_output.weight", "self_attn.o_proj.weight", same),
    TensorRow("attn_q_norm.weight", "self_attn.q_norm.weight", zero_centred),
    TensorRow("attn_k_norm.weight", "self_attn.k_norm.weight", zero_centred),
)
LINEAR_ROWS = {
    "qwen35moe": (
        TensorRow("attn_qkv.weight", "linear_attn.in_proj_qkv.weight", tiled_qkv_rows),
        TensorRow("attn_gate.weight", "linear_attn.in_proj_z.weight", tiled_value_rows),
        TensorRow("ssm_beta.weight", "linear_attn.in_proj_b.weight", tiled_head_rows),
        TensorRow("ssm_alpha.weight", "linear_attn.in_proj_a.weight", tiled_head_rows),
        TensorRow("ssm_a", "linear_attn.A_log", tiled_decay_rate),
        TensorRow("ssm_dt.bias", "linear_attn.dt_bias", tiled_head_rows),
        TensorRow("ssm_conv1d.weight", "linear_attn.conv1d.weight", tiled_conv_kernel),
        TensorRow("ssm_norm.weight", "linear_attn.norm.weight", same),
        TensorRow("ssm_out.weight", "linear_attn.out_proj.weight", tiled_value_columns),
    ),
    "qwen3next": (
        TensorRow("attn_qkv.weight", "linear_attn.in_proj_qkvz.weight", qkvz_qkv),
        TensorRow("attn_gate.weight", "linear_attn.in_proj_qkvz.weight", qkvz_z),
        TensorRow("ssm_ba.weight", "linear_attn.in_proj_ba.weight", same),
        TensorRow("ssm_a", "linear_attn.A_log", decay_rate),
        TensorRow("ssm_dt.bias", "linear_attn.dt_bias", same),
        TensorRow("ssm_conv1d.weight", "linear_attn.conv1d.weight", conv_kernel),
        TensorRow("ssm_norm.weight", "linear_attn.norm.weight", same),
        TensorRow("ssm_out.weight", "linear_attn.out_proj.weight", same),
    ),
}
HEAD_ROW = TensorRow("output.weight", "lm_head.weight", same)  # outside the text model's prefix
EXPERT_ROLES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def layer_rows(shape: Shape, layer: int) -> tuple[TensorRow, ...]:
    """The non-expert tensor rows of `layer` (linear or full attention), in writing order."""
    if shape.layer_types[layer] == "linear_attention":
        return LAYER_ROWS[:1] + LINEAR_ROWS[GGUF_ARCHS[shape.arch]] + LAYER_ROWS[1:]
    return LAYER_ROWS[:1] + ATTENTION_ROWS + LAYER_ROWS[1:]


def role_of(gguf_name: str) -> str:
    """`blk.N.ssm_dt.bias` -> `ssm_dt`: the name `gguf_writer.tensor_type` types by."""
    base = gguf_name.split(".", 2)[2] if gguf_name.startswith("blk.") else gguf_name
    return base.removesuffix(".weight").removesuffix(".bias")


def out_shape(row: TensorRow, hf_shape: tuple[int, ...], la: LinearAttentionShape) -> tuple[int, ...]:
    """The GGUF tensor's numpy shape, found by running the transform on a tensor with no data."""
    return tuple(row.transform(torch.empty(hf_shape, device="meta"), la).shape)
