"""`synth --gguf TYPE`: one GGUF file of synth's own weights, typed per llama.cpp's mixes."""

from __future__ import annotations

import numpy as np
import pytest

from freetoken.loader.gguf_writer import FILE_TYPES, tensor_type
from freetoken.loader.synth_cli import synth_main
from freetoken.loader.synth_gguf import write_synthetic_gguf
from freetoken.quant.ggml_blocks import BLOCK_SIZES, GGMLType
from freetoken.quant.quantize import error_bound

gguf = pytest.importorskip("gguf")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _field(reader, key: str):
    field = reader.fields[key]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode()
    return field.parts[field.data[0]][0]


def _safetensors_weights(model_dir) -> dict[str, np.ndarray]:
    tensors = safetensors_torch.load_file(str(model_dir / "model.safetensors"))
    return {name: t.float().numpy() for name, t in tensors.items()}


def _expected(hf: dict[str, np.ndarray], num_layers: int, num_experts: int) -> dict[str, np.ndarray]:
    """The GGUF tensors, by GGUF name, from the safetensors checkpoint's weights."""
    out = {
        "token_embd.weight": hf["model.embed_tokens.weight"],
        "output_norm.weight": hf["model.norm.weight"],
        "output.weight": hf["lm_head.weight"],
    }
    parts = {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate_inp": "mlp.gate",
    }
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for role, part in parts.items():
            out[f"blk.{i}.{role}.weight"] = hf[f"{p}{part}.weight"]
        for role, proj in (("ffn_gate_exps", "gate_proj"), ("ffn_up_exps", "up_proj"), ("ffn_down_exps", "down_proj")):
            out[f"blk.{i}.{role}.weight"] = np.stack(
                [hf[f"{p}mlp.experts.{e}.{proj}.weight"] for e in range(num_experts)]
            )
    return out


def _role_and_layer(name: str) -> tuple[str, int | None]:
    parts = name.split(".")
    if parts[0] == "blk":
        return parts[2], int(parts[1])
    return parts[0], None


@pytest.mark.parametrize("file_type", [t for t in FILE_TYPES if t != "MXFP4"])  # (MXFP4: gpt_oss's, its own tests)
def test_gguf_holds_synth_weights_in_the_mix_types(file_type, make_checkpoint, tmp_path):
    # 8 layers show a mix's Q6_K layers and its others; fewer experts keep that cheap.
    layers, experts = (8, 2) if file_type.endswith("_M") else (2, 8)
    model_dir = make_checkpoint("qwen3_moe", "tiny-gguf", layers=layers, experts=experts)
    path = write_synthetic_gguf(
        tmp_path / "m.gguf", "qwen3_moe", "tiny-gguf", file_type=file_type, layers=layers, experts=experts
    )
    reader = gguf.GGUFReader(str(path))
    expected = _expected(_safetensors_weights(model_dir), layers, experts)
    stored = {t.name: t for t in reader.tensors}
    assert set(stored) == set(expected)
    kinds = set()
    for name, want in expected.items():
        t = stored[name]
        role, layer = _role_and_layer(name)
        qtype = tensor_type(file_type, role, layer, layers)
        assert int(t.tensor_type) == int(qtype), name
        kinds.add(qtype)
        raw = np.ascontiguousarray(t.data).view(np.uint8)
        elems, nbytes = BLOCK_SIZES[qtype]
        raw = raw.reshape(*want.shape[:-1], want.shape[-1] // elems * nbytes)
        got = gguf.quants.dequantize(raw, t.tensor_type)
        assert got.shape == want.shape, name
        if qtype in (GGMLType.F32, GGMLType.BF16):
            assert np.array_equal(got, want), name  # the very weights of the safetensors synth
        else:
            assert np.all(np.abs(got - want) <= error_bound(qtype, want)), name
    main, more = FILE_TYPES[file_type]
    assert {main, more, GGMLType.F32} == kinds
    assert _field(reader, "general.architecture") == "qwen3moe"
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.ggml.pre") == "qwen2"
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 1024
    assert "<|im_start|>" in _field(reader, "tokenizer.chat_template")
    assert _field(reader, "qwen3moe.expert_count") == experts
    assert _field(reader, "qwen3moe.block_count") == layers


def test_mix_gives_more_bits_to_the_first_last_and_every_third_layer():
    def more(layer: int, n: int) -> bool:
        return tensor_type("Q4_K_M", "ffn_down_exps", layer, n) == GGMLType.Q6_K

    assert [i for i in range(48) if more(i, 48)] == [*range(6), *range(8, 42, 3), *range(42, 48)]
    assert tensor_type("Q4_K_M", "ffn_gate_exps", 0, 48) == GGMLType.Q4_K
    assert tensor_type("Q5_K_M", "output", None, 48) == GGMLType.Q6_K
    assert tensor_type("Q8_0", "attn_k_norm", 3, 48) == GGMLType.F32


def test_refusals_name_the_problem(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"token_embd\.weight: rows of 64 elements are not whole Q4_K"):
        write_synthetic_gguf(tmp_path / "m.gguf", "qwen3_moe", "tiny", file_type="Q4_K_M")
    assert not list(tmp_path.iterdir())  # nothing half-written is left behind
    with pytest.raises(ValueError, match="choose one of: Q8_0, Q4_K_M"):
        write_synthetic_gguf(tmp_path / "m.gguf", "qwen3_moe", "tiny", file_type="Q3_K")
    out = str(tmp_path / "m.gguf")
    assert synth_main(["--arch", "mixtral", "--preset", "tiny-gguf", "--gguf", "Q8_0", "--out", out]) == 2
    assert "qwen3_moe" in capsys.readouterr().err


def test_cli_writes_one_gguf_file(tmp_path):
    out = tmp_path / "one-layer.gguf"
    argv = ["--arch", "qwen3_moe", "--preset", "tiny-gguf", "--layers", "1", "--gguf", "q8_0", "--out", str(out)]
    assert synth_main(argv) == 0
    assert [p.name for p in tmp_path.iterdir()] == [out.name]
    reader = gguf.GGUFReader(str(out))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert embd.tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert [int(n) for n in embd.shape] == [256, 1024]  # GGUF order: ne0 (the row) first
    assert synth_main([*argv, "--max-shard-size", "1GB"]) == 2


def test_the_cli_names_every_file_type():
    from freetoken.loader.synth_cli import GGUF_FILE_TYPES

    assert GGUF_FILE_TYPES == tuple(FILE_TYPES)
