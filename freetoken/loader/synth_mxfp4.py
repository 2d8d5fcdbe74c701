"""`synth --arch gpt_oss --mxfp4`: a synthetic gpt-oss checkpoint with its experts stored as the
released checkpoints store them: MXFP4 codes and scales (`gate_up_proj_blocks` [E, 2I, H/32, 16],
`gate_up_proj_scales` [E, 2I, H/32], the same for `down_proj` with a row per output), the biases
in bf16, and `quantization_config` naming the method and the modules left unquantized.

`write_mxfp4_checkpoint` quantizes each shard as synth makes it, so the disk only ever holds the
MXFP4 checkpoint (gpt-oss-120b's shapes in bf16 are four times its size);
`convert_experts_to_mxfp4` rewrites a checkpoint synth has written, one file at a time. Either
way the largest tensor held at once is one layer's experts, and the files are the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from freetoken.loader.presets import preset_shape
from freetoken.loader.synth import write_synthetic_checkpoint
from freetoken.quant.mxfp4 import BLOCK, quantize_mxfp4

INDEX_FILE = "model.safetensors.index.json"
# what the released checkpoints' quantization_config leaves in bf16
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def write_mxfp4_checkpoint(out_dir: str | Path, arch: str, preset: str, **synth_args) -> Path:
    """`write_synthetic_checkpoint` (same arguments) with the experts quantized shard by shard."""
    if arch != "gpt_oss":
        raise ValueError(f"--mxfp4 applies to gpt_oss checkpoints, not {arch!r}")
    shape = preset_shape(arch, preset)
    _check_sizes(shape.hidden_size, shape.moe_intermediate_size)
    out = write_synthetic_checkpoint(out_dir, arch, preset, shard_transform=mxfp4_experts, **synth_args)
    _mark_quantized(out / "config.json")
    return out


def mxfp4_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One shard's tensors with every `mlp.experts.gate_up_proj` / `down_proj` replaced by its
    MXFP4 blocks and scales (the other tensors as they are)."""
    converted = {}
    for name, tensor in tensors.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            # stored [E, in, out]; MXFP4 keeps a row per output with blocks along the inputs
            converted[name + "_blocks"], converted[name + "_scales"] = quantize_mxfp4(tensor.transpose(1, 2))
        else:
            converted[name] = tensor
    return converted


def convert_experts_to_mxfp4(checkpoint: str | Path) -> None:
    """Replace every `mlp.experts.gate_up_proj` / `down_proj` of a gpt-oss checkpoint directory with
    its MXFP4 blocks and scales, and mark the config."""
    root = Path(checkpoint)
    config_path = root / "config.json"
    config = json.loads(config_path.read_text())
    if config.get("model_type") != "gpt_oss":
        raise ValueError(f"--mxfp4 applies to gpt_oss checkpoints, not {config.get('model_type')!r}")
    _check_sizes(config["hidden_size"], config["intermediate_size"])
    index_path = root / INDEX_FILE
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    files = sorted({*index["weight_map"].values()}) if index else ["model.safetensors"]
    total_bytes = 0
    for file in files:
        converted = mxfp4_experts(load_file(root / file))
        save_file(converted, root / file, metadata={"format": "pt"})
        total_bytes += sum(t.nbytes for t in converted.values())
        if index:
            index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != file}
            index["weight_map"].update(dict.fromkeys(converted, file))
    if index:
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        index.setdefault("metadata", {})["total_size"] = total_bytes
        index_path.write_text(json.dumps(index, indent=2) + "\n")
    _mark_quantized(config_path)


def _check_sizes(hidden: int, inter: int) -> None:
    if hidden % BLOCK or inter % BLOCK:
        raise ValueError(f"--mxfp4 needs hidden and expert sizes that are multiples of {BLOCK}, "
                         f"got {hidden} and {inter}")


def _mark_quantized(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
