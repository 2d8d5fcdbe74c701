"""The equal-memory slot count against llama.cpp counts the file's bytes as llama.cpp places them (its
token embedding table in host memory, as ours)."""

from __future__ import annotations

import pytest

from benchmarks.gguf_equal_memory import equal_memory
from freetoken.loader.gguf_file import GgufFile
from freetoken.loader.synth_gguf import write_synthetic_gguf


def test_equal_memory_counts_dense_tensors_and_the_gpu_layers_experts(tmp_path):
    path = write_synthetic_gguf(tmp_path / "m.gguf", "qwen3_moe", "tiny-gguf", file_type="Q8_0", layers=2, experts=8)
    gguf = GgufFile(path)
    assert "output.weight" in gguf.tensor_names  # untied: the token embedding table stays on the host, both sides
    total = sum(gguf.entry(n).raw.nbytes for n in gguf.tensor_names if n != "token_embd.weight")
    layer1_experts = sum(gguf.entry(f"blk.1.ffn_{p}_exps.weight").raw.nbytes for p in ("gate", "up", "down"))
    layer0_experts = sum(gguf.entry(f"blk.0.ffn_{p}_exps.weight").raw.nbytes for p in ("gate", "up", "down"))
    every = equal_memory(path, 0)
    assert every["llama_gpu_weight_bytes"] == total
    one = equal_memory(path, 1)  # layer 0's experts on the CPU
    assert one["llama_gpu_weight_bytes"] == total - layer0_experts
    assert one["slots"] == (total - layer0_experts - one["our_dense_bytes"]) // one["slot_bytes"]
    assert layer1_experts == layer0_experts
    with pytest.raises(SystemExit, match="no slot fits"):
        equal_memory(path, 2)
