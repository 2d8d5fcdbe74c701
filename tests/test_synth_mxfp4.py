"""synth --mxfp4 (`write_mxfp4_checkpoint`) draws gpt-oss's experts as MXFP4 codes and scales
(never in bf16, never quantized) and everything else as synth draws it: the stored tensors, their
statistics and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from freetoken.loader.presets import preset_shape
from freetoken.loader.synth import tensor_specs, write_synthetic_checkpoint
from freetoken.loader.synth_mxfp4 import EXPERT_TENSORS, draw_mxfp4_experts, write_mxfp4_checkpoint
from freetoken.quant.mxfp4 import dequantize_mxfp4


def _stored(root) -> dict[str, torch.Tensor]:
    index = json.loads((root / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        loaded = load_file(root / file)
        assert all(index["weight_map"][k] == file for k in loaded)
        tensors.update(loaded)
    assert tensors.keys() == index["weight_map"].keys()
    return tensors


def test_experts_are_drawn_as_mxfp4_and_the_rest_as_synth_draws_it(tmp_path):
    args = dict(layers=3, experts=4, top_k=2, seed=4, max_shard_bytes=1 << 16)  # several shards, experts among them
    streamed = _stored(write_mxfp4_checkpoint(tmp_path / "m", "gpt_oss", "demo", **args))
    plain = _stored(write_synthetic_checkpoint(tmp_path / "bf16", "gpt_oss", "demo", **args))
    specs = {s.name: s for s in tensor_specs(preset_shape("gpt_oss", "demo", layers=3, experts=4, top_k=2))}
    experts = [name for name in plain if name.endswith(EXPERT_TENSORS)]
    assert len(experts) == 6
    for name in experts:
        blocks, scales = draw_mxfp4_experts(specs[name], "gpt_oss", 4)
        e, inputs, outputs = plain.pop(name).shape
        assert blocks.shape == (e, outputs, inputs // 32, 16) and scales.shape == (e, outputs, inputs // 32)
        assert torch.equal(streamed.pop(name + "_blocks"), blocks)
        assert torch.equal(streamed.pop(name + "_scales"), scales)
    assert streamed.keys() == plain.keys() and all(torch.equal(streamed[k], plain[k]) for k in plain)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"


def test_drawn_experts_have_synths_scale_and_every_code():
    shape = preset_shape("gpt_oss", "demo", layers=1, experts=3, top_k=2)
    for spec in tensor_specs(shape):
        if spec.name.endswith(EXPERT_TENSORS):
            blocks, scales = draw_mxfp4_experts(spec, "gpt_oss", 0)
            values = dequantize_mxfp4(blocks, scales)
            assert 2**-0.5 < values.std().item() / spec.std < 2**0.5  # the nearest power of two
            assert set(torch.cat((blocks & 15, blocks >> 4)).unique().tolist()) == set(range(16))
            assert scales.max() - scales.min() == 2
            other_seed, _ = draw_mxfp4_experts(spec, "gpt_oss", 1)
            assert not torch.equal(blocks, other_seed) and not torch.equal(blocks[0], blocks[1])


@pytest.mark.parametrize(("arch", "preset", "message"), [
    ("qwen3_moe", "demo", "applies to gpt_oss"),
    ("gpt_oss", "tiny", "multiples of 32, got 64 and 48"),
])
def test_what_mxfp4_cannot_store_is_refused_before_anything_is_written(tmp_path, arch, preset, message):
    with pytest.raises(ValueError, match=message):
        write_mxfp4_checkpoint(tmp_path / "m", arch, preset)
    assert not (tmp_path / "m").exists()
