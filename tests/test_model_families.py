"""The model side's shape: one family per supported arch, composed of the shared blocks; one
bundle of dense ops; kernels below the model (they import no model or engine code)."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import freetoken
from freetoken.config import SUPPORTED_ARCHS, ModelConfig
from freetoken.models.families import FAMILIES, family_of
from freetoken.models.ops import REFERENCE_OPS, DenseOps, fused_ops
from freetoken.models.transformer import fused_decode_supported
from freetoken.reference.norms import add_rms_norm, rms_norm
from freetoken.reference.rotary import Rotary

PACKAGE = Path(freetoken.__file__).parent


def _config(arch: str) -> ModelConfig:
    return ModelConfig(arch=arch, vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=4, intermediate_size=8, moe_intermediate_size=8, num_experts=4, top_k=2,
                       norm_topk_prob=True)


def test_every_supported_arch_has_its_family():
    assert sorted(FAMILIES) == sorted(SUPPORTED_ARCHS)
    for arch in SUPPORTED_ARCHS:
        assert family_of(_config(arch)).arch == arch


def test_the_family_files_hold_the_differences():
    assert [arch for arch in SUPPORTED_ARCHS if not fused_decode_supported(_config(arch))] == [
        "olmoe", "gpt_oss", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe"]
    assert [arch for arch, f in FAMILIES.items() if f.router.weights_fp32] == ["mixtral"]
    # ModelConfig keeps the normalised record the loader and the routing hook read; it agrees.
    for arch, family in FAMILIES.items():
        raw = {"model_type": arch, "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1,
               "vocab_size": 8, "num_experts_per_tok": 2, "num_experts": 4, "num_local_experts": 4,
               "intermediate_size": 8, "head_dim": 8, "linear_num_key_heads": 1, "linear_num_value_heads": 1,
               "linear_key_head_dim": 4, "linear_value_head_dim": 4, "layer_types": ["full_attention"]}
        if arch == "qwen3_5_moe":  # (its text model's fields sit in text_config)
            raw = {"model_type": arch, "text_config": {**raw, "model_type": "qwen3_5_moe_text"}}
        assert ModelConfig.from_hf_dict(raw).router_weights_fp32 == family.router.weights_fp32


def test_the_ops_bundles():
    assert (REFERENCE_OPS.rms_norm, REFERENCE_OPS.add_rms_norm, REFERENCE_OPS.rotate) == (
        rms_norm, add_rms_norm, Rotary.apply)
    assert REFERENCE_OPS.decode is None
    fused = fused_ops()
    assert isinstance(fused, DenseOps) and fused.decode is not None
    for bundle in (fused, fused.decode):
        assert all(callable(getattr(bundle, f.name)) for f in fields(bundle) if f.name != "decode")


def test_kernels_import_no_model_or_engine_code():
    found = []
    for path in (PACKAGE / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [f"{path.relative_to(PACKAGE)}: {n}" for n in names
                      if n.startswith(("freetoken.models", "freetoken.engine"))]
    assert not found
