"""Random-weight checkpoints written as one GGUF file (`synth --gguf TYPE`): qwen3_moe as
llama.cpp's qwen3moe, the hybrid Qwens as qwen35moe / qwen3next (their tables: loader/gguf_hybrid.py),
gpt_oss as gpt-oss with MXFP4 experts (`--gguf MXFP4`; loader/gguf_gpt_oss.py).

The weights are synth's own: every tensor is drawn exactly as `loader/synth.py` draws it for
the same arch, preset, seed and dtype, so `synth --out DIR` and `synth --gguf BF16` describe
the same model, and a quantized file is that model quantized. Experts are drawn per expert (as
the safetensors layout stores them) and stacked into GGUF's per-layer expert tensors when
their turn to be written comes, so memory stays about one tensor. gpt_oss's experts are
drawn as MXFP4 codes exactly as `synth --mxfp4` draws them, so `synth --gguf MXFP4` and `synth
--mxfp4 --out DIR` hold the same blocks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from freetoken.loader import gguf_gpt_oss, gguf_hybrid
from freetoken.loader import tokenizer_builder as tb
from freetoken.loader.chat_templates import chat_template_for
from freetoken.loader.gguf_writer import GGUF_ARCH, GGUFTensor, Qwen3MoeHyper, parse_file_type, tensor_type, write_gguf
from freetoken.loader.presets import Shape, preset_shape
from freetoken.loader.synth import DTYPES, TensorSpec, make_tensors, tensor_specs
from freetoken.loader.synth_gpt_oss import config_fields as gpt_oss_config_fields
from freetoken.loader.synth_mxfp4 import draw_mxfp4_experts
from freetoken.progress import Progress

# HF name inside a layer -> GGUF role, for the tensors that are not experts.
_LAYER_ROLES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
}
_EXPERT_ROLES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def hyper_of(shape: Shape) -> Qwen3MoeHyper:
    special = tb.SpecialTokens(shape.arch)
    return Qwen3MoeHyper(
        context_length=shape.max_position_embeddings,
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        # qwen3_5_moe's config has no dense MLP size (every layer is MoE), so its GGUF has none;
        # gpt_oss's intermediate_size is its experts'
        dense_intermediate_size=None if shape.arch in ("qwen3_5_moe", "qwen3_5_moe_text")
        else shape.moe_intermediate_size if shape.arch == "gpt_oss" else shape.dense_intermediate_size,
        expert_intermediate_size=shape.moe_intermediate_size,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        rope_theta=shape.rope_theta,
        rms_norm_eps=shape.rms_norm_eps,
        num_experts=shape.num_experts,
        top_k=shape.top_k,
        vocab_size=shape.vocab_size,
        bos_id=special.config_bos_id,
        eos_id=special.config_eos_id,
        pad_id=tb.token_id("<|endoftext|>"),
    )


def _producer(specs: list[TensorSpec], arch: str, seed: int, dtype: str, transform=None):
    """Draw `specs` as synth does (at `dtype`), stacked when there are several, as float32;
    a single tensor passes through `transform(fp32 tensor)` when one is given."""

    def produce() -> np.ndarray:
        drawn = make_tensors(specs, arch, seed, dtype)
        if len(specs) == 1:
            t = drawn[specs[0].name].float()
            return (t if transform is None else transform(t)).contiguous().numpy()
        out = np.empty((len(specs), *specs[0].shape), dtype=np.float32)
        for e, spec in enumerate(specs):
            out[e] = drawn.pop(spec.name).float().numpy()
        return out

    return produce


def gguf_tensors(shape: Shape, file_type: str, seed: int, dtype: str) -> list[GGUFTensor]:
    """Every tensor of the GGUF file, in writing order, with its type in `file_type`."""
    if shape.arch in gguf_hybrid.GGUF_ARCHS:
        return hybrid_gguf_tensors(shape, file_type, seed, dtype)
    specs = {s.name: s for s in tensor_specs(shape)}
    arch, n = shape.arch, shape.num_layers

    def one(gguf_name: str, role: str, layer: int | None, group: list[TensorSpec]) -> GGUFTensor:
        stacked = (len(group), *group[0].shape) if len(group) > 1 else group[0].shape
        qtype = tensor_type(file_type, role, layer, n)
        return GGUFTensor(gguf_name, stacked, qtype, _producer(group, arch, seed, dtype))

    out = [one("token_embd.weight", "token_embd", None, [specs["model.embed_tokens.weight"]])]
    for i in range(n):
        hf = f"model.layers.{i}."
        for part, role in _LAYER_ROLES.items():
            out.append(one(f"blk.{i}.{role}.weight", role, i, [specs[f"{hf}{part}.weight"]]))
        for proj, role in _EXPERT_ROLES.items():
            group = [specs[f"{hf}mlp.experts.{e}.{proj}.weight"] for e in range(shape.num_experts)]
            out.append(one(f"blk.{i}.{role}.weight", role, i, group))
    out.append(one("output_norm.weight", "output_norm", None, [specs["model.norm.weight"]]))
    out.append(one("output.weight", "output", None, [specs["lm_head.weight"]]))
    return out


def hybrid_gguf_tensors(shape: Shape, file_type: str, seed: int, dtype: str) -> list[GGUFTensor]:
    """The hybrid Qwens' GGUF tensors: each table row of loader/gguf_hybrid.py drawn as synth
    draws its transformers tensor, then transformed; the experts stacked per layer."""
    gguf_hybrid.check_shape(shape)
    specs = {s.name: s for s in tensor_specs(shape)}
    arch, n, la = shape.arch, shape.num_layers, shape.linear_attention
    top = "model.language_model." if arch == "qwen3_5_moe" else "model."

    def one(row: gguf_hybrid.TensorRow, gguf_name: str, hf_name: str, layer: int | None) -> GGUFTensor:
        spec = specs[hf_name]
        qtype = tensor_type(file_type, gguf_hybrid.role_of(gguf_name), layer, n)
        produce = _producer([spec], arch, seed, dtype, lambda t: row.transform(t, la))
        return GGUFTensor(gguf_name, gguf_hybrid.out_shape(row, spec.shape, la), qtype, produce)

    out = [one(row, row.gguf, top + row.hf, None) for row in gguf_hybrid.TOP_ROWS[:1]]
    for i in range(n):
        hf = f"{top}layers.{i}."
        out += [one(row, f"blk.{i}.{row.gguf}", hf + row.hf, i) for row in gguf_hybrid.layer_rows(shape, i)]
        for proj, role in gguf_hybrid.EXPERT_ROLES.items():
            group = [specs[f"{hf}mlp.experts.{e}.{proj}.weight"] for e in range(shape.num_experts)]
            qtype = tensor_type(file_type, role, i, n)
            out.append(GGUFTensor(f"blk.{i}.{role}.weight", (len(group), *group[0].shape), qtype,
                                  _producer(group, arch, seed, dtype)))
    out += [one(row, row.gguf, top + row.hf, None) for row in gguf_hybrid.TOP_ROWS[1:]]
    head = gguf_hybrid.HEAD_ROW
    out.append(one(head, head.gguf, head.hf, None))
    return out


def gpt_oss_gguf_tensors(shape: Shape, seed: int, dtype: str) -> list[GGUFTensor]:
    """gpt_oss's GGUF tensors: each drawn as synth draws it, the experts' MXFP4 codes as
    `synth --mxfp4` draws them (rows per output, blocks along the inputs)."""
    specs = {s.name: s for s in tensor_specs(shape)}

    def drawn(name: str) -> torch.Tensor:
        return make_tensors([specs[name]], shape.arch, seed, dtype)[name]

    def mxfp4(layer: int, tensor: str) -> tuple[torch.Tensor, torch.Tensor]:
        return draw_mxfp4_experts(specs[f"model.layers.{layer}.mlp.experts.{tensor}"], shape.arch, seed)

    return gguf_gpt_oss.gguf_tensors(hyper_of(shape), lambda name, _: drawn(name).float().numpy(), mxfp4)


def write_synthetic_gguf(
    out_file: str | Path,
    arch: str,
    preset: str = "tiny-gguf",
    *,
    file_type: str,
    layers: int | None = None,
    experts: int | None = None,
    top_k: int | None = None,
    seed: int = 0,
    dtype: str = "bfloat16",
    quiet: bool = True,
) -> Path:
    """Write synth's random-weight model of `arch` at `preset` as one GGUF of `file_type`
    (Q8_0, Q4_K_M, Q5_K_M, Q6_K, BF16, F32; MXFP4 for gpt_oss, and only that). ValueError for
    another arch, an unknown type, or a shape whose rows are not whole blocks of a tensor's type
    (or that llama.cpp cannot hold)."""
    file_type = parse_file_type(file_type)
    gguf_archs = {"qwen3_moe": GGUF_ARCH, **gguf_hybrid.GGUF_ARCHS, "gpt_oss": gguf_gpt_oss.GGUF_ARCH}
    if arch not in gguf_archs:
        raise ValueError(f"synth --gguf writes {', '.join(gguf_archs)} models (llama.cpp's "
                         f"{', '.join(sorted(set(gguf_archs.values())))}) only; got arch {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    gpt_oss = arch == "gpt_oss"
    if gpt_oss != (file_type == gguf_gpt_oss.FILE_TYPE) or (gpt_oss and dtype != "bfloat16"):
        raise ValueError(f"gpt_oss is written as --gguf {gguf_gpt_oss.FILE_TYPE} (MXFP4 experts as released, BF16 "
                         "for the rest, so --dtype bfloat16), and only gpt_oss so")
    shape = preset_shape(arch, preset, layers=layers, experts=experts, top_k=top_k)
    tensors = gpt_oss_gguf_tensors(shape, seed, dtype) if gpt_oss else gguf_tensors(shape, file_type, seed, dtype)
    gguf_arch = gguf_archs[arch]
    hybrid = arch in gguf_hybrid.GGUF_ARCHS
    if hybrid:
        extra, pre = gguf_hybrid.metadata_rows(shape), gguf_hybrid.PRE_TOKENIZERS[gguf_arch]
    elif gpt_oss:
        yarn = gpt_oss_config_fields(shape)["rope_parameters"]
        extra, pre = gguf_gpt_oss.metadata_rows(shape.sliding_window, yarn), gguf_gpt_oss.PRE_TOKENIZER
    else:
        extra, pre = [], "qwen2"
    if not quiet:
        print(f"synth: {arch} preset={preset} layers={shape.num_layers} experts={shape.num_experts} "
              f"-> {out_file} ({gguf_arch} {file_type})", file=sys.stderr, flush=True)
    with Progress("synth", len(tensors), unit="tensors", quiet=quiet) as progress:
        return write_gguf(
            out_file,
            hyper_of(shape),
            tensors,
            file_type=file_type,
            tokenizer_json=tb.tokenizer_json_for(arch, shape.tokenizer_vocab_size),
            chat_template=chat_template_for(arch),
            name=f"freetoken-synth {arch} {preset} seed {seed}",
            progress=progress,
            arch=gguf_arch,
            extra_metadata=extra,
            pre_tokenizer=pre,
        )
