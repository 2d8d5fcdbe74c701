"""Write a checkpoint directory as one GGUF file for llama.cpp, the baseline we race.

    python -m benchmarks.export_gguf --model DIR --out model.gguf [--type BF16]

A thin caller of `freetoken/loader/gguf_writer.py` (metadata, tokenizer, type mixes): the
checkpoint's weights, read in bf16, become its GGUF tensors. qwen3_moe: at BF16 both engines
serve the identical model bit for bit. gpt_oss with MXFP4 experts (`synth --mxfp4`, or the
released checkpoints): `--type MXFP4`, its only type, the experts' blocks repacked into GGML's
order (loader/gguf_gpt_oss.py), never requantized, the rest BF16 and F32, so freetoken serves
the file and the directory with the same logits. Synthetic models can be written as GGUF
directly with `python -m freetoken synth --gguf TYPE`; this is for a checkpoint directory
already on disk.
"""

from __future__ import annotations

import argparse
import json
from contextlib import ExitStack
from pathlib import Path

import msgspec
import numpy as np
import torch

from freetoken.config import ModelConfig
from freetoken.loader import gguf_gpt_oss
from freetoken.loader.checkpoint import TensorReader, load_weights
from freetoken.loader.gguf_writer import FILE_TYPES, GGUFTensor, Qwen3MoeHyper, tensor_type, write_gguf
from freetoken.models.weights import MoEWeights
from freetoken.progress import Progress
from freetoken.quant.mxfp4 import BLOCK, BLOCK_BYTES


def _hyper(model_dir: Path, cfg: ModelConfig) -> Qwen3MoeHyper:
    generation = model_dir / "generation_config.json"
    pad = json.loads(generation.read_text()).get("pad_token_id") if generation.is_file() else None
    return Qwen3MoeHyper(
        context_length=cfg.max_position_embeddings,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        dense_intermediate_size=cfg.intermediate_size,
        expert_intermediate_size=cfg.moe_intermediate_size,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
        vocab_size=cfg.vocab_size,
        bos_id=cfg.bos_token_id,
        eos_id=cfg.eos_token_ids[0],
        pad_id=pad,
    )


def export(model_dir: Path, out: Path, file_type: str | None = None) -> Path:
    cfg = ModelConfig.from_dir(model_dir)
    if cfg.arch == "gpt_oss":
        if file_type not in (None, gguf_gpt_oss.FILE_TYPE):
            raise SystemExit(f"export_gguf writes gpt_oss as --type {gguf_gpt_oss.FILE_TYPE} only")
        return _export_gpt_oss(model_dir, out, cfg)
    file_type = file_type or "BF16"
    if file_type == gguf_gpt_oss.FILE_TYPE:
        raise SystemExit(f"--type {file_type} is gpt_oss's (its released experts); not for {cfg.arch}")
    if cfg.arch != "qwen3_moe" or not all(cfg.sparse_layers):
        raise SystemExit("export_gguf writes qwen3_moe checkpoints whose every layer is MoE, and gpt_oss ones")
    _, w = load_weights(model_dir, torch.bfloat16)
    tensors: list[GGUFTensor] = []

    def put(name: str, t: torch.Tensor, layer: int | None = None) -> None:
        role = name.split(".")[2] if layer is not None else name.split(".")[0]
        qtype = tensor_type(file_type, role, layer, cfg.num_layers)
        tensors.append(GGUFTensor(name, tuple(t.shape), qtype, lambda t=t: t.float().contiguous().numpy()))

    I = cfg.moe_intermediate_size
    put("token_embd.weight", w.embed)
    put("output_norm.weight", w.final_norm)
    put("output.weight", w.lm_head)
    for i, layer in enumerate(w.layers):
        a, m = layer.attn, layer.mlp
        assert isinstance(m, MoEWeights)
        put(f"blk.{i}.attn_norm.weight", layer.input_norm, i)
        put(f"blk.{i}.attn_q.weight", a.wq, i)
        put(f"blk.{i}.attn_k.weight", a.wk, i)
        put(f"blk.{i}.attn_v.weight", a.wv, i)
        put(f"blk.{i}.attn_output.weight", a.wo, i)
        put(f"blk.{i}.attn_q_norm.weight", a.q_norm, i)
        put(f"blk.{i}.attn_k_norm.weight", a.k_norm, i)
        put(f"blk.{i}.ffn_norm.weight", layer.post_attention_norm, i)
        put(f"blk.{i}.ffn_gate_inp.weight", m.router, i)  # [E, H]
        put(f"blk.{i}.ffn_gate_exps.weight", m.w13[:, :I], i)  # [E, I, H]
        put(f"blk.{i}.ffn_up_exps.weight", m.w13[:, I:], i)  # [E, I, H]
        put(f"blk.{i}.ffn_down_exps.weight", m.w2, i)  # [E, H, I]
    return _write(model_dir, out, cfg, tensors, file_type)


def _write(model_dir: Path, out: Path, cfg: ModelConfig, tensors: list[GGUFTensor], file_type: str,
           **layout) -> Path:
    template = model_dir / "chat_template.jinja"
    with Progress("export_gguf", len(tensors), unit="tensors") as progress:
        return write_gguf(
            out,
            _hyper(model_dir, cfg),
            tensors,
            file_type=file_type,
            tokenizer_json=(model_dir / "tokenizer.json").read_text(encoding="utf-8"),
            chat_template=template.read_text(encoding="utf-8") if template.is_file() else None,
            name=model_dir.name,
            progress=progress,
            **layout,
        )


def _export_gpt_oss(model_dir: Path, out: Path, cfg: ModelConfig) -> Path:
    """gpt_oss with MXFP4 experts: each tensor read when its turn comes, the experts' blocks and
    scales as stored."""
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    with ExitStack() as stack:
        reader = TensorReader(model_dir, stack)
        if not reader.has("model.layers.0.mlp.experts.gate_up_proj_blocks"):
            raise SystemExit("export_gguf writes gpt_oss checkpoints with MXFP4 experts (synth --mxfp4, or the "
                             "released ones); this one's are not")

        def dense(name: str, shape: tuple[int, ...]) -> np.ndarray:
            return reader.get(name, shape, torch.float32).numpy()

        def mxfp4(layer: int, tensor: str) -> tuple[torch.Tensor, torch.Tensor]:
            rows, cols = (2 * I, H) if tensor == "gate_up_proj" else (H, I)
            base = f"model.layers.{layer}.mlp.experts.{tensor}"
            return (reader.get_packed(base + "_blocks", (E, rows, cols // BLOCK, BLOCK_BYTES)),
                    reader.get_packed(base + "_scales", (E, rows, cols // BLOCK)))

        yarn = msgspec.structs.asdict(cfg.rope_scaling) if cfg.rope_scaling is not None else None
        rows = gguf_gpt_oss.metadata_rows(cfg.sliding_window or 0, yarn, cfg.sliding_layers)
        tensors = gguf_gpt_oss.gguf_tensors(_hyper(model_dir, cfg), dense, mxfp4)
        return _write(model_dir, out, cfg, tensors, gguf_gpt_oss.FILE_TYPE, arch=gguf_gpt_oss.GGUF_ARCH,
                      extra_metadata=rows, pre_tokenizer=gguf_gpt_oss.PRE_TOKENIZER)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--type", default=None, choices=list(FILE_TYPES),
                   help="GGUF file type (default BF16; gpt_oss: MXFP4, its only one)")
    args = p.parse_args()
    export(Path(args.model), Path(args.out), args.type)


if __name__ == "__main__":
    main()
