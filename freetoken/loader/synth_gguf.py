"""Random-weight qwen3_moe checkpoints written as one GGUF file (`synth --gguf TYPE`).

The weights are synth's own: every tensor is drawn exactly as `loader/synth.py` draws it for
the same arch, preset, seed and dtype, so `synth --out DIR` and `synth --gguf BF16` describe
the same model, and a quantized file is that model quantized. Experts are drawn per expert (as
the safetensors layout stores them) and stacked into GGUF's per-layer expert tensors when
their turn to be written comes, so memory stays about one tensor.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from freetoken.loader import tokenizer_builder as tb
from freetoken.loader.chat_templates import chat_template_for
from freetoken.loader.gguf_writer import GGUFTensor, Qwen3MoeHyper, parse_file_type, tensor_type, write_gguf
from freetoken.loader.presets import Shape, preset_shape
from freetoken.loader.synth import DTYPES, TensorSpec, make_tensors, tensor_specs
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
        dense_intermediate_size=shape.dense_intermediate_size,
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


def _producer(specs: list[TensorSpec], arch: str, seed: int, dtype: str):
    """Draw `specs` as synth does (at `dtype`), stacked when there are several, as float32."""

    def produce() -> np.ndarray:
        drawn = make_tensors(specs, arch, seed, dtype)
        if len(specs) == 1:
            return drawn[specs[0].name].float().numpy()
        out = np.empty((len(specs), *specs[0].shape), dtype=np.float32)
        for e, spec in enumerate(specs):
            out[e] = drawn.pop(spec.name).float().numpy()
        return out

    return produce


def gguf_tensors(shape: Shape, file_type: str, seed: int, dtype: str) -> list[GGUFTensor]:
    """Every tensor of the GGUF file, in writing order, with its type in `file_type`."""
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
    (Q8_0, Q4_K_M, Q5_K_M, Q6_K, BF16). ValueError for another arch, an unknown type, or a
    shape whose rows are not whole blocks of a tensor's type."""
    file_type = parse_file_type(file_type)
    if arch != "qwen3_moe":
        raise ValueError(f"synth --gguf writes qwen3_moe models (llama.cpp's qwen3moe) only; got arch {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    shape = preset_shape(arch, preset, layers=layers, experts=experts, top_k=top_k)
    tensors = gguf_tensors(shape, file_type, seed, dtype)
    if not quiet:
        print(f"synth: {arch} preset={preset} layers={shape.num_layers} experts={shape.num_experts} "
              f"-> {out_file} ({file_type})", file=sys.stderr, flush=True)
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
        )
