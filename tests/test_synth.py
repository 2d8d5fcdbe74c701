"""Synthetic checkpoints: loadable by transformers with no missing or unexpected keys, parsed
to the same numbers by our config, deterministic, sharded on request."""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from freetoken.config import SUPPORTED_ARCHS, ModelConfig
from freetoken.loader import presets, synth
from freetoken.loader.qwen3_5_fields import HYBRID_ARCHS
from freetoken.loader.synth import ensure_demo_checkpoint, write_synthetic_checkpoint
from freetoken.loader.synth_cli import add_synth_arguments, run_synth, synth_main

# the families the shared presets lay out (the hybrid ones have their own: tests/test_qwen3_5_synth.py)
SHARED_PRESET_ARCHS = tuple(arch for arch in SUPPORTED_ARCHS if arch not in HYBRID_ARCHS)

transformers = pytest.importorskip("transformers")


def load_hf(model_dir: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"{model_dir.name}: {problems}"
    return model


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                out[key] = f.get_tensor(key)
    return out


def file_digests(model_dir: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir()) if p.is_file()
    }


def check_config_agrees(model_dir: Path, hf_config) -> ModelConfig:
    cfg = ModelConfig.from_dir(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    assert cfg.arch == raw["model_type"] == hf_config.model_type
    assert cfg.vocab_size == hf_config.vocab_size
    assert cfg.hidden_size == hf_config.hidden_size
    assert cfg.num_layers == hf_config.num_hidden_layers
    assert cfg.num_heads == hf_config.num_attention_heads
    assert cfg.num_kv_heads == hf_config.num_key_value_heads
    derived = hf_config.hidden_size // hf_config.num_attention_heads
    assert cfg.head_dim == (getattr(hf_config, "head_dim", None) or derived)
    assert cfg.top_k == hf_config.num_experts_per_tok
    hf_experts = getattr(hf_config, "num_experts", None) or hf_config.num_local_experts
    assert cfg.num_experts == hf_experts
    if cfg.arch in ("mixtral", "olmoe", "gpt_oss"):  # their intermediate_size is the expert size
        assert cfg.moe_intermediate_size == hf_config.intermediate_size
    else:
        assert cfg.moe_intermediate_size == hf_config.moe_intermediate_size
    if cfg.arch not in ("mixtral", "gpt_oss"):  # (gpt_oss's softmax over the top-k needs no renormalising)
        assert cfg.norm_topk_prob == hf_config.norm_topk_prob
    assert cfg.rms_norm_eps == hf_config.rms_norm_eps
    assert cfg.rope_theta == hf_config.rope_parameters["rope_theta"]
    assert cfg.tie_word_embeddings is False and hf_config.tie_word_embeddings is False
    if cfg.arch == "qwen2_moe":
        assert cfg.shared_expert_intermediate_size == hf_config.shared_expert_intermediate_size
        assert cfg.qkv_bias
    assert cfg.qk_norm == {"qwen3_moe": "head", "olmoe": "full"}.get(cfg.arch, "none")
    assert all(cfg.sparse_layers) and len(cfg.sparse_layers) == cfg.num_layers
    return cfg


@pytest.mark.parametrize("arch", SHARED_PRESET_ARCHS)
def test_tiny_loads_in_transformers_and_parses(make_checkpoint, arch):
    d = make_checkpoint(arch)
    model = load_hf(d)
    cfg = check_config_agrees(d, model.config)
    shape = presets.preset_shape(arch, "tiny")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_experts, cfg.top_k) == (64, 2, 8, 2)
    assert cfg.moe_intermediate_size == shape.moe_intermediate_size == 48
    # Weights are stored per expert, in the family's names, as published checkpoints are.
    names = set(read_tensors(d))
    # (gpt_oss's are fused per layer, as transformers saves them)
    expert = {"mixtral": "model.layers.1.block_sparse_moe.experts.7.w2.weight",
              "gpt_oss": "model.layers.1.mlp.experts.down_proj"}.get(
        arch, "model.layers.1.mlp.experts.7.down_proj.weight")
    assert expert in names
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
    assert any("gate_up_proj" in n for n in names) == (arch == "gpt_oss")
    # Tokenizer ids in config.json agree with the tokenizer.
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    vocab = json.loads((d / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    eos = cfg.eos_token_ids[0]
    assert ids[tok_cfg["eos_token"]] == eos
    assert (d / "chat_template.jinja").read_text() == tok_cfg["chat_template"]
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] is not None


def test_family_specific_tensors(make_checkpoint):
    q3 = read_tensors(make_checkpoint("qwen3_moe"))
    shape = presets.preset_shape("qwen3_moe", "tiny")
    assert shape.head_dim * shape.num_heads != shape.hidden_size  # decoupled, as in the real model
    assert q3["model.layers.0.self_attn.q_norm.weight"].shape == (shape.head_dim,)
    assert q3["model.layers.0.self_attn.q_proj.weight"].shape == (shape.num_heads * shape.head_dim, 64)

    ol = read_tensors(make_checkpoint("olmoe"))
    s = presets.preset_shape("olmoe", "tiny")
    assert ol["model.layers.0.self_attn.q_norm.weight"].shape == (s.num_heads * s.head_dim,)
    assert ol["model.layers.0.self_attn.k_norm.weight"].shape == (s.num_kv_heads * s.head_dim,)

    q2 = read_tensors(make_checkpoint("qwen2_moe"))
    s = presets.preset_shape("qwen2_moe", "tiny")
    assert q2["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 64)
    shared_down = q2["model.layers.0.mlp.shared_expert.down_proj.weight"]
    assert shared_down.shape == (64, s.shared_expert_intermediate_size)
    assert q2["model.layers.0.self_attn.k_proj.bias"].shape == (s.num_kv_heads * s.head_dim,)

    mx = read_tensors(make_checkpoint("mixtral"))
    assert mx["model.layers.0.block_sparse_moe.gate.weight"].shape == (8, 64)
    assert mx["model.layers.0.block_sparse_moe.experts.0.w1.weight"].shape == (48, 64)
    assert mx["model.layers.0.block_sparse_moe.experts.0.w3.weight"].shape == (48, 64)
    assert mx["model.layers.0.block_sparse_moe.experts.0.w2.weight"].shape == (64, 48)

    for tensors in (q3, ol, q2, mx):
        assert all(t.dtype == torch.bfloat16 for t in tensors.values())
        norm = tensors["model.layers.0.input_layernorm.weight"].float()
        assert 0.5 < norm.mean() < 1.5 and norm.std() > 0.01  # ones plus noise
        # Output rows past the tokenizer are zero; the rest are random.
        head = tensors["lm_head.weight"].float()
        assert head[presets.TOKENIZER_VOCAB :].abs().max() == 0
        assert head[: presets.TOKENIZER_VOCAB].std() > 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_logits_are_not_degenerate(make_checkpoint, arch):
    model = load_hf(make_checkpoint(arch))
    ids = torch.tensor([[17, 300, 42, 512, 99, 7, 250, 600]])
    with torch.no_grad():
        logits = model(ids).logits[0, :, : presets.TOKENIZER_VOCAB]
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3  # greedy is never a tie
    assert logits.std(dim=-1).min() > 0.5  # peaked, not flat
    greedy = logits.argmax(-1).tolist()
    assert len(set(greedy)) >= 4  # next tokens depend on the context
    out = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :].tolist()
    assert len(set(out)) >= 4


def test_sharded_layout_loads_and_matches_single_file(make_checkpoint, tmp_path):
    arch = "qwen2_moe"
    single = make_checkpoint(arch, seed=7)
    d = write_synthetic_checkpoint(tmp_path / "sharded", arch, "tiny", seed=7, max_shard_bytes=60_000)
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert len(shards) > 3 and not (d / "model.safetensors").exists()
    n = len(shards)
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    tensors = read_tensors(d)
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, fname in index["weight_map"].items():
        with safe_open(str(d / fname), "pt") as f:
            assert name in f.keys()
            assert f.metadata() == {"format": "pt"}
    # No shard is over the limit unless it holds a single bigger tensor.
    for fname in shards:
        with safe_open(str(d / fname), "pt") as f:
            keys = list(f.keys())
        if len(keys) > 1:
            assert (d / fname).stat().st_size < 60_000 + 4096
    reference = read_tensors(single)
    assert all(torch.equal(tensors[k], reference[k]) for k in reference)
    load_hf(d)
    # Writing the single-file layout over a sharded directory leaves no stale shards.
    write_synthetic_checkpoint(d, arch, "tiny", seed=7)
    assert sorted(p.name for p in d.glob("*.safetensors")) == ["model.safetensors"]
    assert not (d / "model.safetensors.index.json").exists()


def test_deterministic_by_seed(make_checkpoint, tmp_path):
    a = make_checkpoint("olmoe", seed=11)
    b = write_synthetic_checkpoint(tmp_path / "again", "olmoe", "tiny", seed=11)
    assert file_digests(a) == file_digests(b)
    c = make_checkpoint("olmoe", seed=12)
    ta, tc = read_tensors(a), read_tensors(c)
    assert set(ta) == set(tc)
    assert all(not torch.equal(ta[k], tc[k]) for k in ta)
    # A tensor does not depend on how many layers or experts come after it.
    fewer = read_tensors(make_checkpoint("olmoe", seed=11, layers=1, experts=6))
    name = "model.layers.0.mlp.experts.5.up_proj.weight"
    assert torch.equal(fewer[name], ta[name])


def test_block_drawing_is_the_same_in_threads(tmp_path):
    shape = presets.preset_shape("qwen3_moe", "small", layers=1)
    specs = [s for s in synth.tensor_specs(shape) if ".experts.1" in s.name or "embed" in s.name][:4]
    big = synth.TensorSpec("x", (5000, 2048), "normal", 0.02)  # several blocks
    specs.append(big)
    threaded = synth.make_tensors(specs, "qwen3_moe", 3, "bfloat16")
    serial = {s.name: synth.make_tensor(s, "qwen3_moe", 3, "bfloat16") for s in specs}
    assert all(torch.equal(threaded[k], serial[k]) for k in serial)
    assert len(synth._blocks(big)) > 1


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("qwen3_moe", {"norm_topk_prob": False, "top_k": 1}),
        ("olmoe", {"norm_topk_prob": True, "top_k": 3, "experts": 6}),
        ("qwen2_moe", {"norm_topk_prob": True, "experts": 6, "top_k": 3, "layers": 3}),
        ("mixtral", {"experts": 6, "top_k": 3, "layers": 1}),
    ],
)
def test_overrides(make_checkpoint, arch, overrides):
    d = make_checkpoint(arch, **overrides)
    model = load_hf(d)
    cfg = check_config_agrees(d, model.config)
    assert cfg.top_k == overrides.get("top_k", 2)
    assert cfg.num_experts == overrides.get("experts", 8)
    assert cfg.num_layers == overrides.get("layers", 2)
    if "norm_topk_prob" in overrides:
        assert cfg.norm_topk_prob is overrides["norm_topk_prob"]
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_bad_overrides():
    with pytest.raises(ValueError, match="norm_topk_prob"):
        presets.preset_shape("mixtral", "tiny", norm_topk_prob=False)
    with pytest.raises(ValueError, match="top-k"):
        presets.preset_shape("olmoe", "tiny", experts=4, top_k=5)
    with pytest.raises(ValueError, match="unknown preset"):
        presets.preset_shape("olmoe", "huge")
    with pytest.raises(ValueError, match="unknown arch"):
        presets.preset_shape("llama", "tiny")


def test_large_preset_configs_parse_without_writing():
    """The 30B-A3B preset in every layout: transformers and our parser agree on the sizes."""
    for arch in SHARED_PRESET_ARCHS:
        shape = presets.preset_shape(arch, "qwen3-30b-a3b")
        raw = synth.config_dict(shape)
        hf = transformers.AutoConfig.for_model(**raw)
        cfg = ModelConfig.from_hf_dict(raw)
        assert (cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.hidden_size) == (48, 128, 8, 2048)
        assert cfg.moe_intermediate_size == 768 and cfg.vocab_size == 151936
        assert cfg.rope_theta == 1e6 == hf.rope_parameters["rope_theta"]
        assert cfg.head_dim == 128
        expert_gb = cfg.num_layers * cfg.num_experts * cfg.expert_bytes_bf16 / 1e9
        assert 57 < expert_gb < 59
    q3 = ModelConfig.from_hf_dict(synth.config_dict(presets.preset_shape("qwen3_moe", "qwen3-30b-a3b")))
    assert (q3.num_heads, q3.num_kv_heads, q3.norm_topk_prob, q3.rms_norm_eps) == (32, 4, True, 1e-6)


def test_real_checkpoint_field_names(make_checkpoint):
    q3 = json.loads((make_checkpoint("qwen3_moe") / "config.json").read_text())
    assert q3["num_experts"] == 8 and q3["architectures"] == ["Qwen3MoeForCausalLM"]
    assert q3["dtype"] == q3["torch_dtype"] == "bfloat16"
    mx = json.loads((make_checkpoint("mixtral") / "config.json").read_text())
    assert mx["num_local_experts"] == 8 and "moe_intermediate_size" not in mx
    assert (mx["bos_token_id"], mx["eos_token_id"]) == (1, 2)


def test_run_synth_cli(tmp_path, capsys):
    assert synth_main(["--arch", "gpt2", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "unknown arch 'gpt2'" in err and "qwen3_moe" in err
    assert synth_main(["--arch", "olmoe", "--preset", "enormous", "--out", str(tmp_path / "x")]) == 2
    assert "unknown preset" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()

    parser = argparse.ArgumentParser()
    add_synth_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--arch", "olmoe", "--norm-topk-prob", "maybe", "--out", "x"])
    args = parser.parse_args(
        ["--arch", "qwen3_moe", "--layers", "1", "--experts", "4", "--top-k", "3", "--norm-topk-prob"]
        + ["false", "--seed", "5", "--max-shard-size", "40KB", "--out", str(tmp_path / "cli")]
    )
    assert run_synth(args) == 0
    err = capsys.readouterr().err
    assert "synth: done" in err
    cfg = ModelConfig.from_dir(tmp_path / "cli")
    assert (cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.norm_topk_prob) == (1, 4, 3, False)
    assert (tmp_path / "cli" / "model.safetensors.index.json").is_file()


def test_demo_checkpoint_is_built_once_and_race_safe(tmp_path):
    cache = tmp_path / "cache"
    results: list[Path] = []
    errors: list[BaseException] = []

    def build():
        try:
            results.append(ensure_demo_checkpoint(cache))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    start = time.monotonic()
    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert time.monotonic() - start < 10
    assert len(set(results)) == 1
    d = results[0]
    assert [p.name for p in cache.iterdir()] == [d.name]  # no temporary directories left
    cfg = ModelConfig.from_dir(d)
    got = (cfg.arch, cfg.hidden_size, cfg.num_layers, cfg.num_experts, cfg.top_k)
    assert got == ("qwen3_moe", 128, 4, 16, 4)
    before = (d / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_checkpoint(cache) == d
    assert (d / "model.safetensors").stat().st_mtime_ns == before
