"""`synth --gguf` of the hybrid Qwens: qwen3_5_moe as llama.cpp's qwen35moe, qwen3_next as its
qwen3next. Read back with the `gguf` package, every tensor must be the safetensors synth's tensor
of the same name under the transform llama.cpp's converter applies (1 + w for zero-centred norms,
-exp(A_log), value heads tiled for qwen35moe, qkvz split for qwen3next), bit for bit at F32 and
BF16; the metadata rows llama.cpp's loader reads must hold the shape's values.

The expected tensors are built here from index arithmetic, not with the writer's own transforms.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.loader.presets import preset_shape
from freetoken.loader.synth_cli import synth_main
from freetoken.loader.synth_gguf import write_synthetic_gguf
from freetoken.quant.ggml_blocks import BLOCK_SIZES, GGMLType

gguf = pytest.importorskip("gguf")
safetensors_torch = pytest.importorskip("safetensors.torch")

EXPERTS = 4  # fewer than the preset's 8: cheaper, and the expert count must follow the override


def _field(reader, key: str):
    field = reader.fields[key]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode()
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return [field.parts[i][0].item() for i in field.data]
    return field.parts[field.data[0]][0].item()


def _weights(model_dir) -> dict[str, np.ndarray]:
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        out.update({n: t.float().numpy() for n, t in safetensors_torch.load_file(str(path)).items()})
    return out


def _tiled(hk: int, r: int, d: int) -> np.ndarray:
    """GGUF value-head index -> checkpoint index: tiled head j*HK + k is grouped head k*r + j."""
    return np.array([(k * r + j) * d + x for j in range(r) for k in range(hk) for x in range(d)])


def _expected(arch: str, hf: dict[str, np.ndarray], shape) -> dict[str, np.ndarray]:
    la, top = shape.linear_attention, "model.language_model." if arch == "qwen3_5_moe" else "model."
    hk, hv, dk, dv = la.key_heads, la.value_heads, la.key_dim, la.value_dim
    r, qk = hv // hk, 2 * hk * dk
    out = {"token_embd.weight": hf[top + "embed_tokens.weight"], "output_norm.weight": 1 + hf[top + "norm.weight"],
           "output.weight": hf["lm_head.weight"]}
    for i, kind in enumerate(shape.layer_types):
        p, b = f"{top}layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = 1 + hf[p + "input_layernorm.weight"]
        out[b + "post_attention_norm.weight"] = 1 + hf[p + "post_attention_layernorm.weight"]
        out[b + "ffn_gate_inp.weight"] = hf[p + "mlp.gate.weight"]
        for proj in ("gate", "up", "down"):
            out[f"{b}ffn_{proj}_shexp.weight"] = hf[f"{p}mlp.shared_expert.{proj}_proj.weight"]
            out[f"{b}ffn_{proj}_exps.weight"] = np.stack(
                [hf[f"{p}mlp.experts.{e}.{proj}_proj.weight"] for e in range(EXPERTS)])
        out[b + "ffn_gate_inp_shexp.weight"] = hf[p + "mlp.shared_expert_gate.weight"][0]
        if kind == "full_attention":
            for ours, theirs in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")):
                out[f"{b}attn_{ours}.weight"] = hf[f"{p}self_attn.{theirs}_proj.weight"]
            out[b + "attn_q_norm.weight"] = 1 + hf[p + "self_attn.q_norm.weight"]
            out[b + "attn_k_norm.weight"] = 1 + hf[p + "self_attn.k_norm.weight"]
            continue
        a = p + "linear_attn."
        conv = hf[a + "conv1d.weight"][:, 0, :]
        out[b + "ssm_norm.weight"] = hf[a + "norm.weight"]
        # torch's fp32 exp, as the block computes the rate (numpy's can differ in the last bit)
        decay = -torch.from_numpy(hf[a + "A_log"]).exp().numpy()
        if arch == "qwen3_next":  # rows per key head: q (dk), k (dk), v (r*dv), z (r*dv)
            qkvz = hf[a + "in_proj_qkvz.weight"].reshape(hk, 2 * dk + 2 * r * dv, -1)
            q, k, v, z = (qkvz[:, s:e].reshape(-1, qkvz.shape[-1]) for s, e in (
                (0, dk), (dk, 2 * dk), (2 * dk, 2 * dk + r * dv), (2 * dk + r * dv, 2 * dk + 2 * r * dv)))
            out[b + "attn_qkv.weight"], out[b + "attn_gate.weight"] = np.concatenate([q, k, v]), z
            out[b + "ssm_ba.weight"] = hf[a + "in_proj_ba.weight"]
            out[b + "ssm_a"], out[b + "ssm_dt.bias"] = decay, hf[a + "dt_bias"]
            out[b + "ssm_conv1d.weight"], out[b + "ssm_out.weight"] = conv, hf[a + "out_proj.weight"]
            continue
        vrows, heads = _tiled(hk, r, dv), _tiled(hk, r, 1)
        qkv = hf[a + "in_proj_qkv.weight"]
        out[b + "attn_qkv.weight"] = np.concatenate([qkv[:qk], qkv[qk:][vrows]])
        out[b + "attn_gate.weight"] = hf[a + "in_proj_z.weight"][vrows]
        out[b + "ssm_beta.weight"] = hf[a + "in_proj_b.weight"][heads]
        out[b + "ssm_alpha.weight"] = hf[a + "in_proj_a.weight"][heads]
        out[b + "ssm_a"], out[b + "ssm_dt.bias"] = decay[heads], hf[a + "dt_bias"][heads]
        out[b + "ssm_conv1d.weight"] = np.concatenate([conv[:qk], conv[qk:][vrows]])
        out[b + "ssm_out.weight"] = hf[a + "out_proj.weight"][:, vrows]
    return out


def _read(t) -> tuple[GGMLType, np.ndarray]:
    qtype = GGMLType(int(t.tensor_type))
    shape = tuple(int(n) for n in reversed(t.shape))
    raw = np.ascontiguousarray(t.data).view(np.uint8)
    elems, nbytes = BLOCK_SIZES[qtype]
    raw = raw.reshape(*shape[:-1], shape[-1] // elems * nbytes)
    return qtype, gguf.quants.dequantize(raw, t.tensor_type)


@pytest.mark.parametrize("arch, gguf_arch", [("qwen3_5_moe", "qwen35moe"), ("qwen3_next", "qwen3next")])
@pytest.mark.parametrize("file_type", ["F32", "BF16"])
def test_gguf_holds_the_safetensors_synth(arch, gguf_arch, file_type, make_checkpoint, tmp_path):
    model_dir = make_checkpoint(arch, "tiny-gguf", experts=EXPERTS)
    path = write_synthetic_gguf(tmp_path / "m.gguf", arch, "tiny-gguf", file_type=file_type, experts=EXPERTS)
    shape = preset_shape(arch, "tiny-gguf", experts=EXPERTS)
    expected = _expected(arch, _weights(model_dir), shape)
    reader = gguf.GGUFReader(str(path))
    stored = {t.name: t for t in reader.tensors}
    assert set(stored) == set(expected)
    for name, want in expected.items():
        qtype, got = _read(stored[name])
        assert got.shape == want.shape, name
        # F32 where llama.cpp's converter keeps it (1-D, norms, routers, conv), else the file's type
        f32 = want.ndim == 1 or name.endswith(("ffn_gate_inp.weight", "ssm_conv1d.weight"))
        assert qtype == (GGMLType.F32 if f32 or file_type == "F32" else GGMLType.BF16), name
        assert np.array_equal(got, want.astype(np.float32)), name

    la = shape.linear_attention
    assert _field(reader, "general.architecture") == gguf_arch
    want_rows = {
        "block_count": 4, "embedding_length": 256, "expert_count": EXPERTS, "expert_used_count": 2,
        "expert_feed_forward_length": 256, "expert_shared_feed_forward_length": 256,
        "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 64,
        "attention.value_length": 64, "rope.dimension_count": 16, "full_attention_interval": 4,
        "ssm.conv_kernel": la.conv_width, "ssm.state_size": la.key_dim, "ssm.group_count": la.key_heads,
        "ssm.time_step_rank": la.value_heads, "ssm.inner_size": la.value_heads * la.value_dim,
        "attention.recurrent_layers": [True, True, True, False],
    }
    for key, value in want_rows.items():
        assert _field(reader, f"{gguf_arch}.{key}") == value, key
    if gguf_arch == "qwen35moe":
        assert _field(reader, "qwen35moe.rope.dimension_sections") == [11, 11, 10, 0]
        assert f"{gguf_arch}.feed_forward_length" not in reader.fields  # its config has no dense MLP
        assert _field(reader, "tokenizer.ggml.pre") == "qwen35"
    else:
        assert _field(reader, "qwen3next.feed_forward_length") == shape.dense_intermediate_size
    assert _field(reader, "general.file_type") == (0 if file_type == "F32" else 32)  # ALL_F32, MOSTLY_BF16


def test_shapes_llama_cpp_cannot_hold_are_refused(tmp_path, capsys):
    # tiny's linear layers have key heads of 6 and value heads of 5; llama.cpp takes one size
    with pytest.raises(ValueError, match="key dim 6, value dim 5"):
        write_synthetic_gguf(tmp_path / "m.gguf", "qwen3_5_moe", "tiny", file_type="BF16")
    assert not list(tmp_path.iterdir())
    out = str(tmp_path / "m.gguf")
    assert synth_main(["--arch", "mixtral", "--preset", "tiny", "--gguf", "BF16", "--out", out]) == 2
    assert "qwen3_5_moe" in capsys.readouterr().err
