"""gpt-oss GGUF files (loader/gguf_gpt_oss.py, loader/gguf_mxfp4.py): GGML's MXFP4 blocks moved into
the checkpoint's order and back without changing a bit or a value (against `gguf`'s
dequantization and ours); a synthetic MXFP4 checkpoint exported to GGUF, and the same seed written
by `synth --gguf MXFP4`, hold the same tensors; freetoken serves the file and the directory with
the same config, the same fp32 logits bit for bit and 32 greedy tokens (resident, transfer and
the CPU kernel), transformers' on the directory included; the metadata reads back; missing keys,
values freetoken does not compute and experts that are not MXFP4 are refused by name.
(transformers' own GGUF loader is not compared: in the installed version it fails on gpt-oss's
rope.scaling keys, and without them leaves the experts, their biases and the sinks unloaded.)
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from benchmarks.export_gguf import export
from freetoken.config import ModelConfig
from freetoken.errors import CheckpointError
from freetoken.loader import gguf_gpt_oss
from freetoken.loader import tokenizer_builder as tb
from freetoken.loader.gguf_writer import GGUFTensor, write_gguf
from freetoken.loader.presets import preset_shape
from freetoken.loader.synth_gguf import gpt_oss_gguf_tensors, hyper_of, write_synthetic_gguf
from freetoken.loader.synth_mxfp4 import write_mxfp4_checkpoint
from freetoken.moe.mxfp4_format import Mxfp4ExpertFormat
from freetoken.quant.ggml_blocks import GGMLType, dequantize
from freetoken.quant.mxfp4 import checkpoint_to_ggml, dequantize_mxfp4, ggml_to_checkpoint
from tests.test_gpt_oss import _reference_greedy
from tests.test_gpt_oss_mxfp4 import _greedy, _prompt, _runner

Q = gguf.GGMLQuantizationType
SYNTH = dict(preset="demo", seed=5, layers=3, experts=5, top_k=2)
POLICIES = [("resident", None), ("transfer", 5), ("cpu", None)]


def test_ggml_blocks_move_into_the_checkpoints_order_and_back_bit_for_bit():
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (3, 4, 6, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(0, 251, raw.shape[:-1])  # exponents whose largest values stay finite
    blocks, scales = ggml_to_checkpoint(torch.from_numpy(raw))
    assert blocks.shape == (3, 4, 6, 16) and scales.shape == (3, 4, 6)
    assert np.array_equal(checkpoint_to_ggml(blocks, scales).numpy(), raw)
    ours = dequantize_mxfp4(blocks, scales).reshape(3, 4, 192).numpy()
    reference = gguf.quants.dequantize(raw.reshape(3, 4, -1), Q.MXFP4)
    # equal values; bit for bit but the sign of zero (gguf's table has no -0, the checkpoint's code 8 is -0)
    assert np.array_equal(ours, reference) and not np.array_equal(ours.view(np.uint32), reference.view(np.uint32))
    assert np.array_equal(np.abs(ours).view(np.uint32), np.abs(reference).view(np.uint32))
    assert np.array_equal(dequantize(GGMLType.MXFP4, raw.reshape(3, 4, -1), 192).view(np.uint32),
                          reference.view(np.uint32))
    codes = torch.from_numpy(rng.integers(0, 256, (5, 2, 16), dtype=np.uint8))
    exps = torch.from_numpy(rng.integers(0, 256, (5, 2), dtype=np.uint8))
    again = ggml_to_checkpoint(checkpoint_to_ggml(codes, exps))
    assert torch.equal(again[0], codes) and torch.equal(again[1], exps)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(the MXFP4 safetensors directory, its GGUF export, synth --gguf MXFP4 of the same seed)."""
    root = tmp_path_factory.mktemp("gpt_oss_gguf")
    kwargs = {k: v for k, v in SYNTH.items() if k != "preset"}
    model_dir = write_mxfp4_checkpoint(root / "dir", "gpt_oss", SYNTH["preset"], **kwargs)
    exported = export(model_dir, root / "export.gguf")
    synth = write_synthetic_gguf(root / "synth.gguf", "gpt_oss", SYNTH["preset"], file_type="MXFP4", **kwargs)
    return model_dir, exported, synth


def _tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def _field(path, key: str):
    return gguf.GGUFReader(str(path)).fields[key].contents()


def test_the_export_and_synth_hold_the_same_tensors(files):
    _, exported, synth = files
    a, b = _tensors(exported), _tensors(synth)
    assert list(a) == list(b) and len(a) == 3 + SYNTH["layers"] * 19  # 13 per layer and 6 of experts
    for name, t in a.items():
        assert t.tensor_type == b[name].tensor_type and np.array_equal(t.data, b[name].data), name
    types = {name: t.tensor_type.name for name, t in a.items()}
    assert types["blk.1.ffn_gate_exps.weight"] == types["blk.1.ffn_down_exps.weight"] == "MXFP4"
    assert types["blk.1.ffn_up_exps.bias"] == types["blk.0.attn_sinks.weight"] == "F32"
    assert types["blk.0.ffn_gate_inp.weight"] == types["blk.2.attn_q.bias"] == "F32"
    assert types["blk.0.attn_q.weight"] == types["output.weight"] == types["token_embd.weight"] == "BF16"


def test_metadata_reads_back(files):
    model_dir, path, _ = files
    cfg = ModelConfig.from_dir(model_dir)
    assert _field(path, "general.architecture") == "gpt-oss" and _field(path, "general.file_type") == 38
    assert _field(path, "gpt-oss.attention.sliding_window") == cfg.sliding_window
    assert _field(path, "gpt-oss.expert_feed_forward_length") == cfg.moe_intermediate_size
    assert _field(path, "gpt-oss.rope.scaling.type") == "yarn"
    assert _field(path, "gpt-oss.rope.scaling.factor") == cfg.rope_scaling.factor
    assert _field(path, "gpt-oss.rope.scaling.original_context_length") == \
        cfg.rope_scaling.original_max_position_embeddings
    assert _field(path, "tokenizer.ggml.pre") == "gpt-4o"
    assert "<|channel|>" in _field(path, "tokenizer.chat_template")  # Harmony
    assert ModelConfig.from_checkpoint(path) == cfg


def test_the_file_serves_the_directorys_logits_bit_for_bit(files):
    model_dir, path, _ = files
    prompt = _prompt(70)
    want_reference = _reference_greedy(model_dir, torch.tensor([prompt]))
    for placement in POLICIES:
        file_runner = _runner(path, *placement)
        fmt = file_runner.pool.format
        assert isinstance(fmt, Mxfp4ExpertFormat) and fmt.bias_dtype == torch.float32  # the file's F32 biases
        tokens, logits = _greedy(file_runner, prompt)
        file_runner.close()
        dir_runner = _runner(model_dir, *placement)
        want_tokens, want_logits = _greedy(dir_runner, prompt)
        dir_runner.close()
        assert len(set(tokens)) > 1, "degenerate checkpoint: one repeated token"
        assert tokens == want_tokens == want_reference, placement
        assert torch.equal(logits, want_logits), placement


def _write(path, shape, *, skip: str = "", rows=(), tensors=None):
    """A gpt-oss GGUF of `shape` without the metadata row `skip`, with `rows` added."""
    yarn = {"factor": 32.0, "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0}
    extra = [r for r in gguf_gpt_oss.metadata_rows(shape.sliding_window, yarn) if r[0] != skip] + list(rows)
    return write_gguf(path, hyper_of(shape), tensors or gpt_oss_gguf_tensors(shape, 0, "bfloat16"),
                      file_type="MXFP4", tokenizer_json=tb.tokenizer_json_for("gpt_oss", 1000), chat_template=None,
                      name="t", arch="gpt-oss", extra_metadata=extra, pre_tokenizer="gpt-4o")


def test_missing_and_unsupported_metadata_are_named(tmp_path):
    shape = preset_shape("gpt_oss", "demo", layers=2, experts=2, top_k=1)
    path = _write(tmp_path / "a.gguf", shape, skip="attention.sliding_window")
    with pytest.raises(CheckpointError, match="metadata key 'gpt-oss.attention.sliding_window' is missing"):
        ModelConfig.from_checkpoint(path)
    for key, value, message in (
        ("rope.scaling.type", "linear", "rope.scaling.type: 'linear' is not supported"),
        ("expert_weights_scale", 2.5, "expert_weights_scale = 2.5 is not supported"),
        ("rope.dimension_count", 16, "rope.dimension_count = 16: gpt-oss turns and attends over whole heads"),
        ("rope.freq_base_swa", 5.0, "rope.freq_base_swa: a rotary base of its own"),
    ):
        skip = key if key == "rope.scaling.type" else ""
        path = _write(tmp_path / f"{key}.gguf", shape, skip=skip, rows=[(key, value)])
        with pytest.raises(CheckpointError, match=message):
            ModelConfig.from_checkpoint(path)


def test_a_sliding_pattern_reads_back(tmp_path):
    shape = preset_shape("gpt_oss", "demo", layers=3, experts=2, top_k=1)
    path = _write(tmp_path / "p.gguf", shape, rows=gguf_gpt_oss.metadata_rows(32, None, (False, True, True))[1:])
    assert ModelConfig.from_checkpoint(path).sliding_layers == (False, True, True)
    path = _write(tmp_path / "q.gguf", shape, rows=[("attention.sliding_window_pattern", 3)])
    assert ModelConfig.from_checkpoint(path).sliding_layers == (True, True, False)


def test_experts_that_are_not_mxfp4_are_refused_by_name(tmp_path):
    shape = preset_shape("gpt_oss", "demo", layers=1, experts=2, top_k=1)
    tensors = [GGUFTensor(t.name, t.shape, GGMLType.BF16, lambda s=t.shape: np.zeros(s, np.float32))
               if t.name == "blk.0.ffn_up_exps.weight" else t for t in gpt_oss_gguf_tensors(shape, 0, "bfloat16")]
    path = _write(tmp_path / "bf16.gguf", shape, tensors=tensors)
    with pytest.raises(CheckpointError, match="'blk.0.ffn_up_exps.weight' is stored as BF16; gpt-oss experts"):
        _runner(path)


def test_synth_writes_gpt_oss_as_mxfp4_only(tmp_path):
    with pytest.raises(ValueError, match="gpt_oss is written as --gguf MXFP4"):
        write_synthetic_gguf(tmp_path / "m.gguf", "gpt_oss", "demo", file_type="BF16", layers=1)
    with pytest.raises(ValueError, match="gpt_oss is written as --gguf MXFP4"):
        write_synthetic_gguf(tmp_path / "m.gguf", "qwen3_moe", "tiny", file_type="MXFP4", layers=1)
    assert not list(tmp_path.iterdir())
