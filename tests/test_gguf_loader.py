"""GGUF model files: metadata into ModelConfig, dense weights by transformers name, raw expert
blocks, split files, and the errors for what is not supported."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from freetoken.config import ModelConfig
from freetoken.errors import CheckpointError
from freetoken.loader.checkpoint import load_weights, open_tensor_reader, read_expert_banks
from freetoken.loader.gguf_file import GgufFile, row_bytes
from tests.gguf_testfiles import Q, write_gguf


@pytest.fixture(scope="module")
def source(make_checkpoint):
    return make_checkpoint("qwen3_moe", "tiny")


@pytest.fixture(scope="module")
def gguf_files(source, tmp_path_factory):
    """type name -> a GGUF file of the tiny model (dense weights in that type)."""
    root = tmp_path_factory.mktemp("gguf")
    return {
        "f32": write_gguf(source, root / "f32.gguf", Q.F32, Q.F32, Q.F32),
        "bf16": write_gguf(source, root / "bf16.gguf"),
        "q8_0": write_gguf(source, root / "q8.gguf", Q.Q8_0, Q.Q8_0, Q.BF16),
    }


def _expected_config(source) -> ModelConfig:
    """The source's config as llama.cpp runs it: one eos id, top-k weights renormalised."""
    cfg = ModelConfig.from_dir(source)
    return msgspec_replace(cfg, eos_token_ids=cfg.eos_token_ids[:1], norm_topk_prob=True)


def msgspec_replace(cfg: ModelConfig, **changes) -> ModelConfig:
    import msgspec

    return msgspec.structs.replace(cfg, **changes)


@pytest.mark.parametrize("kind", ["f32", "bf16", "q8_0"])
def test_config_from_gguf_metadata_equals_the_checkpoint(source, gguf_files, kind):
    assert ModelConfig.from_checkpoint(gguf_files[kind]) == _expected_config(source)


def test_a_file_without_output_ties_the_head_to_the_embedding(source, tmp_path):
    path = write_gguf(source, tmp_path / "tied.gguf", tied=True)
    cfg = ModelConfig.from_checkpoint(path)
    assert cfg.tie_word_embeddings
    _, w = load_weights(path, torch.float32)
    assert w.lm_head is w.embed


def test_float_files_load_the_checkpoint_weights_exactly(source, gguf_files):
    _, want = load_weights(source, torch.float32)
    for kind in ("f32", "bf16"):  # the synthetic weights are bf16 values: both types hold them exactly
        _, got = load_weights(gguf_files[kind], torch.float32)
        assert torch.equal(got.embed, want.embed) and torch.equal(got.lm_head, want.lm_head)
        for a, b in zip(got.layers, want.layers, strict=True):
            for name in ("wq", "wk", "wv", "wo", "q_norm", "k_norm"):
                assert torch.equal(getattr(a.attn, name), getattr(b.attn, name)), (kind, name)
            assert torch.equal(a.mlp.router, b.mlp.router)
            assert torch.equal(a.mlp.w13, b.mlp.w13) and torch.equal(a.mlp.w2, b.mlp.w2)
            assert torch.equal(a.input_norm, b.input_norm)


def test_quantized_dense_tensors_equal_the_reference_dequantization(gguf_files):
    path = gguf_files["q8_0"]
    reader = gguf.GGUFReader(path)
    stored = {t.name: t for t in reader.tensors}

    def reference(name: str) -> torch.Tensor:
        t = stored[name]
        assert t.tensor_type == Q.Q8_0
        return torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), Q.Q8_0))

    _, got = load_weights(path, torch.float32, experts=False)
    assert torch.equal(got.embed, reference("token_embd.weight"))
    assert torch.equal(got.layers[1].attn.wo, reference("blk.1.attn_output.weight"))
    assert torch.equal(got.layers[0].mlp.router, reference("blk.0.ffn_gate_inp.weight"))
    _, bf16 = load_weights(path, torch.bfloat16, experts=False)
    assert torch.equal(bf16.layers[0].attn.wq, reference("blk.0.attn_q.weight").to(torch.bfloat16))


def test_expert_tensor_gives_raw_blocks_as_views(source, gguf_files):
    cfg = ModelConfig.from_dir(source)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    f = GgufFile(gguf_files["q8_0"])
    gate_type, gate = f.expert_tensor(1, "gate")
    down_type, down = f.expert_tensor(1, "down")
    assert (gate_type, down_type) == (Q.Q8_0, Q.BF16)
    assert gate.dtype == np.uint8 and gate.shape == (E, I, row_bytes(Q.Q8_0, H)) == (E, I, H // 32 * 34)
    assert down.shape == (E, H, 2 * I)
    assert isinstance(gate.base, np.ndarray) and not gate.flags.owndata  # a view of the mapped file
    reference = {t.name: t for t in gguf.GGUFReader(gguf_files["q8_0"]).tensors}["blk.1.ffn_gate_exps.weight"]
    assert np.array_equal(gate.reshape(-1), np.asarray(reference.data).reshape(-1))
    kind, raw, shape = f.tensor("blk.0.attn_q.weight")
    assert kind == Q.Q8_0 and shape == (cfg.num_heads * cfg.head_dim, H) and raw.shape == (shape[0], H // 32 * 34)
    with pytest.raises(ValueError, match="expert projection 'w1'"):
        f.expert_tensor(0, "w1")


def test_bf16_experts_read_into_the_unquantized_banks(source, gguf_files):
    from contextlib import ExitStack

    cfg = ModelConfig.from_dir(source)
    with ExitStack() as stack:
        want = read_expert_banks(open_tensor_reader(source, stack), cfg, 1, torch.bfloat16)
        reader = open_tensor_reader(gguf_files["bf16"], stack)
        got = read_expert_banks(reader, cfg, 1, torch.bfloat16)
        assert reader.stored_dtype("model.layers.1.mlp.experts.gate_up_proj") == torch.bfloat16
        assert any(".experts." in name for name in reader.file_of)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_quantized_experts_are_not_converted_to_float_banks(source, gguf_files):
    from contextlib import ExitStack

    cfg = ModelConfig.from_dir(source)
    with ExitStack() as stack:
        reader = open_tensor_reader(gguf_files["q8_0"], stack)
        assert reader.stored_dtype("model.layers.0.mlp.experts.gate_up_proj") is None
        with pytest.raises(CheckpointError, match="ffn_gate_exps.weight' is stored as Q8_0: quantized experts"):
            read_expert_banks(reader, cfg, 0, torch.bfloat16)


def test_split_files_open_as_one_model(source, gguf_files, tmp_path):
    first = write_gguf(source, tmp_path / "m.gguf", split_max_tensors=10)
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) > 2 and first == parts[0]
    f = GgufFile(first)
    assert len(f.parts) == len(parts) and len(f.tensor_names) == len(GgufFile(gguf_files["bf16"]).tensor_names)
    assert ModelConfig.from_checkpoint(first) == _expected_config(source)
    _, got = load_weights(first, torch.float32)
    _, want = load_weights(gguf_files["bf16"], torch.float32)
    assert torch.equal(got.layers[1].mlp.w2, want.layers[1].mlp.w2) and torch.equal(got.lm_head, want.lm_head)
    with pytest.raises(CheckpointError, match="pass its first part"):
        GgufFile(parts[1])
    parts[-1].unlink()
    with pytest.raises(CheckpointError, match=f"missing: {parts[-1].name}"):
        GgufFile(first)


def test_unsupported_architecture_is_named(source, tmp_path):
    path = write_gguf(source, tmp_path / "llama.gguf", arch="llama")
    with pytest.raises(CheckpointError,
                       match="general.architecture: unsupported 'llama'; supported: gpt-oss, qwen3moe"):
        ModelConfig.from_checkpoint(path)


def test_missing_metadata_key_is_named(source, tmp_path):
    path = write_gguf(source, tmp_path / "nokey.gguf", skip_keys=("expert_count",))
    with pytest.raises(CheckpointError, match="metadata key 'qwen3moe.expert_count' is missing"):
        ModelConfig.from_checkpoint(path)


def test_unsupported_tensor_type_is_named(source, tmp_path):
    path = write_gguf(source, tmp_path / "q4_0.gguf", Q.Q4_0)
    with pytest.raises(CheckpointError, match=r"tensor 'token_embd.weight' is stored as Q4_0; supported: F32, F16"):
        load_weights(path, torch.float32, experts=False)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        GgufFile(bad)
    with pytest.raises(CheckpointError, match="no such GGUF file"):
        GgufFile(tmp_path / "absent.gguf")
