"""synth --mxfp4 quantizes each shard as it is made (`write_mxfp4_checkpoint`, so the bf16
experts never reach the disk) and writes the files that quantizing a written checkpoint
(`convert_experts_to_mxfp4`) gives: the same shards, tensors, index and config."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from freetoken.loader.synth import write_synthetic_checkpoint
from freetoken.loader.synth_mxfp4 import convert_experts_to_mxfp4, write_mxfp4_checkpoint


def test_quantizing_while_writing_gives_the_converted_checkpoint(tmp_path):
    args = dict(layers=3, experts=4, top_k=2, seed=4, max_shard_bytes=1 << 16)  # several shards, experts among them
    streamed = write_mxfp4_checkpoint(tmp_path / "streamed", "gpt_oss", "demo", **args)
    converted = write_synthetic_checkpoint(tmp_path / "converted", "gpt_oss", "demo", **args)
    convert_experts_to_mxfp4(converted)
    files = sorted(p.name for p in streamed.glob("*.safetensors"))
    assert len(files) > 2 and files == sorted(p.name for p in converted.glob("*.safetensors"))
    for name in files:
        got, want = load_file(streamed / name), load_file(converted / name)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert any(k.endswith("gate_up_proj_blocks") for name in files for k in load_file(streamed / name))
    for meta in ("model.safetensors.index.json", "config.json"):
        assert json.loads((streamed / meta).read_text()) == json.loads((converted / meta).read_text())


@pytest.mark.parametrize(("arch", "preset", "message"), [
    ("qwen3_moe", "demo", "applies to gpt_oss"),
    ("gpt_oss", "tiny", "multiples of 32, got 64 and 48"),
])
def test_what_mxfp4_cannot_store_is_refused_before_anything_is_written(tmp_path, arch, preset, message):
    with pytest.raises(ValueError, match=message):
        write_mxfp4_checkpoint(tmp_path / "m", arch, preset)
    assert not (tmp_path / "m").exists()
