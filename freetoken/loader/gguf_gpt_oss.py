"""gpt-oss as llama.cpp's GGUF architecture `gpt-oss`: the metadata beyond the keys every MoE
GGUF has, the tensor names, the types, and how a config is read back from them.

Shape legend: E experts, H hidden, I expert intermediate, V vocabulary, G = columns / 32.

What llama.cpp's converter writes for a gpt-oss checkpoint, and what we write the same way:
- `gpt-oss.` metadata: expert_feed_forward_length (and feed_forward_length) = intermediate_size,
  attention.sliding_window, and the checkpoint's YaRN as rope.scaling.type = yarn, factor,
  original_context_length, yarn_beta_fast, yarn_beta_slow. No layer pattern: llama.cpp slides
  the even layers (a period of 2, which attention.sliding_window_pattern may change), as
  transformers' default `layer_types` does.
- tensors (`LAYER_TENSORS`, `TOP_TENSORS`): q/k/v/o with biases, `attn_sinks`, the norm before
  the experts as `post_attention_norm`, the router as `ffn_gate_inp` weight and bias; the experts
  as `ffn_{gate,up,down}_exps.weight` [E, rows, cols] in MXFP4 and `.bias` [E, rows], gate and
  up split from the checkpoint's interleaved gate_up rows (even rows gate, odd rows up).
- types: experts MXFP4 (the released blocks, repacked: quant/mxfp4.py); biases, sinks, norms
  and the router F32 (the converter keeps every bias, 1-D tensor and router in F32); the other
  weights BF16, a bf16 checkpoint's own values.
Reading a file back, the keys llama.cpp would honour but freetoken does not compute (another
YaRN extrapolation or attention factor, expert weight scaling, a separate sliding-layer rotary
base, a partial rotary) are refused by name unless they hold the value gpt-oss computes.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from freetoken.errors import CheckpointError
from freetoken.loader.gguf_file import GgufFile
from freetoken.loader.gguf_writer import GGUFTensor, Qwen3MoeHyper, tensor_type
from freetoken.quant.ggml_blocks import GGMLType
from freetoken.quant.mxfp4 import checkpoint_to_ggml

GGUF_ARCH = "gpt-oss"
PRE_TOKENIZER = "gpt-4o"  # the o200k split llama.cpp names for gpt-oss's tokenizer
FILE_TYPE = "MXFP4"
DEFAULT_PATTERN = 2  # llama.cpp's sliding-window period for gpt-oss: even layers slide

# (GGUF name, transformers name): at the top, and inside `blk.N.` / `model.layers.N.`
TOP_TENSORS = (
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
)
LAYER_TENSORS = (
    ("attn_norm.weight", "input_layernorm.weight"),
    *((f"attn_{g}.{part}", f"self_attn.{h}_proj.{part}")
      for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")) for part in ("weight", "bias")),
    ("attn_sinks.weight", "self_attn.sinks"),
    ("post_attention_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_gate_inp.weight", "mlp.router.weight"),
    ("ffn_gate_inp.bias", "mlp.router.bias"),
)
# the experts: GGUF projection -> (the checkpoint's MXFP4 tensor, its rows taken: every row, even, odd)
EXPERT_PARTS = {"gate": ("gate_up_proj", slice(0, None, 2)), "up": ("gate_up_proj", slice(1, None, 2)),
                "down": ("down_proj", slice(None))}
# keys llama.cpp honours whose other values freetoken does not compute: key -> the accepted values
_DEFAULT_ONLY = {
    "rope.scaling.yarn_ext_factor": (-1.0, 1.0),
    "rope.scaling.yarn_attn_factor": (1.0,),
    "rope.scaling.yarn_log_multiplier": (0.0,),
    "rope.scaling.attn_factor": (1.0,),
    "expert_weights_scale": (0.0, 1.0),
}


def config_fields(gguf: GgufFile, prefix: str, layers: int) -> dict[str, Any]:
    """The `config.json` fields of gpt-oss a file's metadata gives beyond the common ones:
    `rope_parameters` and `layer_types`. CheckpointError for a value freetoken does not compute."""
    for key, accepted in _DEFAULT_ONLY.items():
        value = gguf.get(prefix + key, accepted[0])
        if value not in accepted:
            raise CheckpointError(f"{gguf.path}: {prefix}{key} = {value} is not supported "
                                  f"(gpt-oss computes {' or '.join(map(str, accepted))})")
    head_dim = gguf.get(prefix + "attention.key_length", None)
    for key in ("attention.value_length", "rope.dimension_count"):
        value = gguf.get(prefix + key, head_dim)
        if value != head_dim:
            raise CheckpointError(f"{gguf.path}: {prefix}{key} = {value}: gpt-oss turns and attends over whole "
                                  f"heads of attention.key_length = {head_dim}")
    base = gguf.get(prefix + "rope.freq_base", None)
    if gguf.get(prefix + "rope.freq_base_swa", base) != base:
        raise CheckpointError(f"{gguf.path}: {prefix}rope.freq_base_swa: a rotary base of its own for the sliding "
                              "layers is not supported (gpt-oss has one for every layer)")
    return {"rope_parameters": _rope(gguf, prefix), "layer_types": _layer_types(gguf, prefix, layers)}


def _rope(gguf: GgufFile, prefix: str) -> dict[str, Any]:
    scaling = gguf.get(prefix + "rope.scaling.type", "none")
    if scaling in ("none", ""):
        return {"rope_type": "default"}
    if scaling != "yarn":
        raise CheckpointError(f"{gguf.path}: {prefix}rope.scaling.type: {scaling!r} is not supported (yarn or none)")
    original = gguf.get(prefix + "rope.scaling.original_context_length", None)
    rope = {"rope_type": "yarn", "factor": gguf.get(prefix + "rope.scaling.factor"),
            "original_max_position_embeddings": original or gguf.get(prefix + "context_length"),
            "truncate": False}  # gpt-oss's own YaRN keeps the ramp's ends where they fall
    for field, key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
        if gguf.has(f"{prefix}rope.scaling.{key}"):
            rope[field] = gguf.get(f"{prefix}rope.scaling.{key}")
    return rope


def _layer_types(gguf: GgufFile, prefix: str, layers: int) -> list[str]:
    pattern = gguf.get(prefix + "attention.sliding_window_pattern", DEFAULT_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise CheckpointError(f"{gguf.path}: {prefix}attention.sliding_window_pattern: {len(pattern)} entries "
                                  f"for {layers} layers")
        sliding = [bool(p) for p in pattern]
    else:  # as llama.cpp reads a period: the last layer of each period sees everything; 0: every layer slides
        period = int(pattern)
        sliding = [period == 0 or i % period < period - 1 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


# -- writing -------------------------------------------------------------------------------

def metadata_rows(sliding_window: int, yarn: dict[str, Any] | None,
                  sliding_layers: tuple[bool, ...] = ()) -> list[tuple[str, Any]]:
    """The `gpt-oss.` rows beyond `gguf_writer`'s common ones; `yarn`: the checkpoint's YaRN
    parameters (factor, original_max_position_embeddings, beta_fast, beta_slow), None for none;
    `sliding_layers`: which layers slide, written only when not llama.cpp's default (even ones)."""
    rows: list[tuple[str, Any]] = [("attention.sliding_window", int(sliding_window))]
    if sliding_layers and any(s != (i % DEFAULT_PATTERN < DEFAULT_PATTERN - 1) for i, s in enumerate(sliding_layers)):
        rows.append(("attention.sliding_window_pattern", [bool(s) for s in sliding_layers]))
    if yarn is not None:
        rows += [("rope.scaling.type", "yarn"), ("rope.scaling.factor", float(yarn["factor"])),
                 ("rope.scaling.original_context_length", int(yarn["original_max_position_embeddings"])),
                 ("rope.scaling.yarn_beta_fast", float(yarn["beta_fast"])),
                 ("rope.scaling.yarn_beta_slow", float(yarn["beta_slow"]))]
    return rows


# dense(transformers name, its shape) -> its values, float32; mxfp4(layer, "gate_up_proj" |
# "down_proj") -> the checkpoint's (blocks [E, rows, G, 16], scales [E, rows, G]) uint8
DenseSource = Callable[[str, tuple[int, ...]], np.ndarray]
Mxfp4Source = Callable[[int, str], tuple[torch.Tensor, torch.Tensor]]


def gguf_tensors(hp: Qwen3MoeHyper, dense: DenseSource, mxfp4: Mxfp4Source) -> list[GGUFTensor]:
    """Every tensor of a gpt-oss GGUF, in writing order, produced on its turn from the sources.
    A layer's gate_up blocks are fetched once for its gate and up tensors."""
    H, I, E, V, n = hp.hidden_size, hp.expert_intermediate_size, hp.num_experts, hp.vocab_size, hp.num_layers
    q, kv = hp.num_heads * hp.head_dim, hp.num_kv_heads * hp.head_dim
    shapes = {"token_embd.weight": (V, H), "output_norm.weight": (H,), "output.weight": (V, H),
              "attn_norm.weight": (H,), "attn_q.weight": (q, H), "attn_q.bias": (q,), "attn_k.weight": (kv, H),
              "attn_k.bias": (kv,), "attn_v.weight": (kv, H), "attn_v.bias": (kv,), "attn_output.weight": (H, q),
              "attn_output.bias": (H,), "attn_sinks.weight": (hp.num_heads,), "post_attention_norm.weight": (H,),
              "ffn_gate_inp.weight": (E, H), "ffn_gate_inp.bias": (E,)}
    blocks = lru_cache(maxsize=1)(mxfp4)

    def one(name: str, shape: tuple[int, ...], layer: int | None, produce: Callable[[], np.ndarray]) -> GGUFTensor:
        base = name.split(".", 2)[2] if layer is not None else name
        role, part = base.rsplit(".", 1)
        qtype = GGMLType.F32 if part != "weight" or len(shape) == 1 else tensor_type(FILE_TYPE, role, layer, n)
        return GGUFTensor(name, shape, qtype, produce)

    def values(hf: str, shape: tuple[int, ...], rows: slice = slice(None)) -> Callable[[], np.ndarray]:
        return lambda: np.ascontiguousarray(dense(hf, shape)[..., rows])

    def experts(layer: int, proj: str) -> Callable[[], np.ndarray]:
        tensor, rows = EXPERT_PARTS[proj]

        def produce() -> np.ndarray:
            b, s = blocks(layer, tensor)
            raw = checkpoint_to_ggml(b[:, rows], s[:, rows])
            return raw.reshape(*raw.shape[:2], -1).numpy()  # [E, rows, G * 17]

        return produce

    top = dict(TOP_TENSORS)
    out = [one("token_embd.weight", shapes["token_embd.weight"], None,
               values(top["token_embd.weight"], shapes["token_embd.weight"]))]
    for i in range(n):
        hf = f"model.layers.{i}."
        out += [one(f"blk.{i}.{g}", shapes[g], i, values(hf + h, shapes[g])) for g, h in LAYER_TENSORS]
        for proj, (tensor, rows) in EXPERT_PARTS.items():
            w_shape = (E, H, I) if proj == "down" else (E, I, H)
            bias_shape = (E, H) if proj == "down" else (E, 2 * I)
            out.append(one(f"blk.{i}.ffn_{proj}_exps.weight", w_shape, i, experts(i, proj)))
            out.append(one(f"blk.{i}.ffn_{proj}_exps.bias", w_shape[:2], i,
                           values(f"{hf}mlp.experts.{tensor}_bias", bias_shape, rows)))
    for g in ("output_norm.weight", "output.weight"):
        out.append(one(g, shapes[g], None, values(top[g], shapes[g])))
    return out
