"""The GGUF export for the llama.cpp baseline holds our weights bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.export_gguf import export
from freetoken.loader.checkpoint import load_weights

gguf = pytest.importorskip("gguf")


def test_gguf_export_round_trips_every_tensor(make_checkpoint, tmp_path):
    model_dir = make_checkpoint("qwen3_moe", "tiny")
    out = tmp_path / "m.gguf"
    export(model_dir, out)
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 3 + 12 * 2  # embed, final norm, head; 12 per layer, 2 layers
    _, w = load_weights(model_dir, torch.bfloat16)
    I = w.layers[0].mlp.w2.shape[2]

    def bits(t: torch.Tensor) -> np.ndarray:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)

    def stored(name: str) -> np.ndarray:
        return np.asarray(tensors[name].data).view(np.uint16).reshape(-1)

    assert np.array_equal(stored("blk.1.ffn_gate_exps.weight"), bits(w.layers[1].mlp.w13[:, :I]).reshape(-1))
    assert np.array_equal(stored("blk.1.ffn_up_exps.weight"), bits(w.layers[1].mlp.w13[:, I:]).reshape(-1))
    assert np.array_equal(stored("blk.0.ffn_down_exps.weight"), bits(w.layers[0].mlp.w2).reshape(-1))
    assert np.array_equal(stored("token_embd.weight"), bits(w.embed).reshape(-1))
    norm = np.asarray(tensors["blk.0.attn_q_norm.weight"].data)
    assert np.array_equal(norm, w.layers[0].attn.q_norm.float().numpy())
    router = np.asarray(tensors["blk.0.ffn_gate_inp.weight"].data)  # F32, as llama.cpp keeps it
    assert np.array_equal(router, w.layers[0].mlp.router.float().numpy())
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "qwen3moe"


def test_gguf_export_quantizes_on_request(make_checkpoint, tmp_path):
    model_dir = make_checkpoint("qwen3_moe", "tiny-gguf", layers=1, experts=2)
    reader = gguf.GGUFReader(str(export(model_dir, tmp_path / "q.gguf", "Q4_K_M")))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
