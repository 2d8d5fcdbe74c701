"""`synth --arch gpt_oss --mxfp4`: a synthetic gpt-oss checkpoint with its experts stored as the
released checkpoints store them: MXFP4 codes and scales (`gate_up_proj_blocks` [E, 2I, H/32, 16],
`gate_up_proj_scales` [E, 2I, H/32], the same for `down_proj` with a row per output), the biases
in bf16, and `quantization_config` naming the method and the modules left unquantized.

Two ways to get one:
- `write_mxfp4_checkpoint` draws the experts' codes and scales directly (`draw_mxfp4_experts`:
  uniform random codes, exponents around the one that gives the tensor synth's standard
  deviation). Nothing is drawn in bf16 and nothing is quantized, so gpt-oss-120b's shapes write
  at disk speed; `synth --gguf MXFP4` draws the very same blocks (loader/synth_gguf.py).
- `convert_experts_to_mxfp4` quantizes the experts of a checkpoint synth has written in bf16,
  one file at a time: a model whose MXFP4 experts are a bf16 model's, for the parity tests.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from freetoken.loader.presets import preset_shape
from freetoken.loader.synth import TensorSpec, write_synthetic_checkpoint
from freetoken.quant.mxfp4 import BLOCK, BLOCK_BYTES, EXPONENT_BIAS, FP4_VALUES, quantize_mxfp4

INDEX_FILE = "model.safetensors.index.json"
# what the released checkpoints' quantization_config leaves in bf16
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# the root mean square of drawn values over 2**(centre - 127): uniform E2M1 codes times a scale
# of 2**-1, 1 or 2 (each block's exponent is the centre's or a neighbour)
_DRAWN_RMS = math.sqrt(sum(v * v for v in FP4_VALUES) / len(FP4_VALUES) * (0.25 + 1 + 4) / 3)


def write_mxfp4_checkpoint(out_dir: str | Path, arch: str, preset: str, **synth_args) -> Path:
    """`write_synthetic_checkpoint` (same arguments) with the experts drawn as MXFP4."""
    if arch != "gpt_oss":
        raise ValueError(f"--mxfp4 applies to gpt_oss checkpoints, not {arch!r}")
    shape = preset_shape(arch, preset)
    _check_sizes(shape.hidden_size, shape.moe_intermediate_size)
    seed = synth_args.get("seed", 0)

    def draw_stored(spec: TensorSpec) -> dict[str, torch.Tensor] | None:
        if not spec.name.endswith(EXPERT_TENSORS):
            return None
        blocks, scales = draw_mxfp4_experts(spec, arch, seed)
        return {spec.name + "_blocks": blocks, spec.name + "_scales": scales}

    out = write_synthetic_checkpoint(out_dir, arch, preset, draw_stored=draw_stored, **synth_args)
    _mark_quantized(out / "config.json")
    return out


def draw_mxfp4_experts(spec: TensorSpec, arch: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The MXFP4 form of an expert tensor spec (stored [E, in, out]): blocks [E, out, in/32, 16]
    and scales [E, out, in/32], a row per output as the checkpoints keep them. Codes are uniform;
    each block's exponent is one of three around the one that gives the spec's standard
    deviation (within a factor of 2**0.5, the nearest power of two). Deterministic in (arch,
    seed, name), with a generator per expert."""
    experts, inputs, outputs = spec.shape
    groups = inputs // BLOCK
    centre = EXPONENT_BIAS + round(math.log2(spec.std / _DRAWN_RMS))
    blocks = np.empty((experts, outputs * groups * BLOCK_BYTES), dtype=np.uint8)
    scales = np.empty((experts, outputs * groups), dtype=np.uint8)
    for e in range(experts):
        digest = hashlib.sha256(f"freetoken-synth-mxfp4/{arch}/{seed}/{spec.name}/{e}".encode()).digest()
        # SFC64's raw words: gigabytes a second, so the largest presets write at disk speed
        bits = np.random.SFC64(int.from_bytes(digest[:8], "little"))
        blocks[e] = bits.random_raw(blocks.shape[1] // 8).view(np.uint8)
        spread = bits.random_raw(-(-scales.shape[1] // 8)).view(np.uint8)[: scales.shape[1]] % 3
        scales[e] = spread + (centre - 1)
    return (torch.from_numpy(blocks).view(experts, outputs, groups, BLOCK_BYTES),
            torch.from_numpy(scales).view(experts, outputs, groups))


def mxfp4_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One shard's tensors with every `mlp.experts.gate_up_proj` / `down_proj` replaced by its
    MXFP4 blocks and scales (the other tensors as they are)."""
    converted = {}
    for name, tensor in tensors.items():
        if name.endswith(EXPERT_TENSORS):
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
