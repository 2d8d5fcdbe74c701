"""Write a qwen3_moe checkpoint as a bf16 GGUF file for llama.cpp, the baseline we race.

    python -m benchmarks.export_gguf --model DIR --out model.gguf

Same weights, bit for bit (bf16; 1-D norm weights in f32, as llama.cpp's bf16 files keep
them), so both engines serve the identical model. Written directly with the `gguf` package:
llama.cpp's own converter refuses tokenizers whose pre-tokenizer it does not recognise, and
ours (a synthetic byte-level BPE) is one of those. The tokenizer is declared as GPT-2 style
BPE with the qwen2 pre-tokenizer and padded with unused tokens up to the model's vocabulary;
benchmarks feed token ids, so text fidelity does not enter the comparison.
Needs `pip install gguf` (not a dependency of freetoken).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from freetoken.config import ModelConfig
from freetoken.loader.checkpoint import load_weights
from freetoken.models.weights import MoEWeights


def _bf16(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def export(model_dir: Path, out: Path) -> None:
    import gguf

    cfg = ModelConfig.from_dir(model_dir)
    if cfg.arch != "qwen3_moe" or not all(cfg.sparse_layers):
        raise SystemExit("export_gguf writes qwen3_moe checkpoints whose every layer is MoE")
    _, w = load_weights(model_dir, torch.bfloat16)
    writer = gguf.GGUFWriter(str(out), "qwen3moe")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.top_k)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    _add_tokenizer(writer, model_dir, cfg)

    def put(name: str, t: torch.Tensor) -> None:
        if t.dim() == 1:
            writer.add_tensor(name, t.float().numpy())
        else:
            writer.add_tensor(name, _bf16(t), raw_dtype=gguf.GGMLQuantizationType.BF16)

    I = cfg.moe_intermediate_size
    put("token_embd.weight", w.embed)
    put("output_norm.weight", w.final_norm)
    put("output.weight", w.lm_head)
    for i, layer in enumerate(w.layers):
        a, m = layer.attn, layer.mlp
        assert isinstance(m, MoEWeights)
        put(f"blk.{i}.attn_norm.weight", layer.input_norm)
        put(f"blk.{i}.attn_q.weight", a.wq)
        put(f"blk.{i}.attn_k.weight", a.wk)
        put(f"blk.{i}.attn_v.weight", a.wv)
        put(f"blk.{i}.attn_output.weight", a.wo)
        put(f"blk.{i}.attn_q_norm.weight", a.q_norm)
        put(f"blk.{i}.attn_k_norm.weight", a.k_norm)
        put(f"blk.{i}.ffn_norm.weight", layer.post_attention_norm)
        put(f"blk.{i}.ffn_gate_inp.weight", m.router)  # [E, H]
        put(f"blk.{i}.ffn_gate_exps.weight", m.w13[:, :I])  # [E, I, H]
        put(f"blk.{i}.ffn_up_exps.weight", m.w13[:, I:])  # [E, I, H]
        put(f"blk.{i}.ffn_down_exps.weight", m.w2)  # [E, H, I]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_tokenizer(writer, model_dir: Path, cfg: ModelConfig) -> None:
    import gguf

    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    special = {a["id"] for a in tok.get("added_tokens", []) if a.get("special")}
    tokens = [f"[PAD{i}]" for i in range(cfg.vocab_size)]
    types = [gguf.TokenType.UNUSED] * cfg.vocab_size
    for text, i in vocab.items():
        if i < cfg.vocab_size:
            tokens[i] = text
            types[i] = gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if cfg.bos_token_id is not None:
        writer.add_bos_token_id(cfg.bos_token_id)
    if cfg.eos_token_ids:
        writer.add_eos_token_id(cfg.eos_token_ids[0])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    export(Path(args.model), Path(args.out))


if __name__ == "__main__":
    main()
