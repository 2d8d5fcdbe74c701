"""Tiny GGUF files written from a synthetic qwen3_moe checkpoint, for the GGUF loader's tests.

2-D weights in the type asked for (F32, BF16 or Q8_0, quantized with the `gguf` package), 1-D
norms in F32 as llama.cpp writes them; experts' gate/up and down types chosen separately.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import torch

from freetoken.config import ModelConfig
from freetoken.loader.checkpoint import load_weights

Q = gguf.GGMLQuantizationType


def _put(writer: gguf.GGUFWriter, name: str, t: torch.Tensor, qtype: Q) -> None:
    values = t.float().contiguous().numpy()
    if values.ndim == 1 or qtype == Q.F32:
        writer.add_tensor(name, values)
    else:
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)


def write_gguf(
    model_dir: Path,
    out: Path,
    dense: Q = Q.BF16,
    gate_up: Q = Q.BF16,
    down: Q = Q.BF16,
    *,
    arch: str = "qwen3moe",
    tied: bool = False,
    skip_keys: tuple[str, ...] = (),
    split_max_tensors: int = 0,
    template: str | None = None,
) -> Path:
    """`out`, or with `split_max_tensors` the split model's first part (returned)."""
    cfg = ModelConfig.from_dir(model_dir)
    _, w = load_weights(model_dir, torch.float32)
    writer = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    keys = {
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_layers,
        "feed_forward_length": cfg.intermediate_size,
        "expert_feed_forward_length": cfg.moe_intermediate_size,
        "attention.head_count": cfg.num_heads,
        "attention.head_count_kv": cfg.num_kv_heads,
        "attention.key_length": cfg.head_dim,
        "attention.value_length": cfg.head_dim,
        "rope.freq_base": cfg.rope_theta,
        "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        "expert_count": cfg.num_experts,
        "expert_used_count": cfg.top_k,
    }
    for key, value in keys.items():
        if key in skip_keys:
            continue
        if isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    _add_tokenizer(writer, model_dir, cfg)
    if template is not None:
        writer.add_chat_template(template)

    I = cfg.moe_intermediate_size
    _put(writer, "token_embd.weight", w.embed, dense)
    _put(writer, "output_norm.weight", w.final_norm, dense)
    if not tied:
        _put(writer, "output.weight", w.lm_head, dense)
    for i, layer in enumerate(w.layers):
        a, m = layer.attn, layer.mlp
        for name, t in (("attn_norm", layer.input_norm), ("attn_q", a.wq), ("attn_k", a.wk), ("attn_v", a.wv),
                        ("attn_output", a.wo), ("attn_q_norm", a.q_norm), ("attn_k_norm", a.k_norm),
                        ("ffn_norm", layer.post_attention_norm), ("ffn_gate_inp", m.router)):
            _put(writer, f"blk.{i}.{name}.weight", t, dense)
        _put(writer, f"blk.{i}.ffn_gate_exps.weight", m.w13[:, :I], gate_up)
        _put(writer, f"blk.{i}.ffn_up_exps.weight", m.w13[:, I:], gate_up)
        _put(writer, f"blk.{i}.ffn_down_exps.weight", m.w2, down)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_max_tensors:
        return next(out.parent.glob(f"{out.stem}-00001-of-*.gguf"))
    return out


def _add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, cfg: ModelConfig) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    for a in added.values():
        vocab[a["content"]] = a["id"]
    tokens = [f"[PAD{i}]" for i in range(cfg.vocab_size)]
    types = [gguf.TokenType.UNUSED] * cfg.vocab_size
    for text, i in vocab.items():
        tokens[i] = text
        if i in added:
            types[i] = gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED
        else:
            types[i] = gguf.TokenType.NORMAL
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    if cfg.bos_token_id is not None:
        writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_ids[0])
