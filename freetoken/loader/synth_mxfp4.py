"""`synth --arch gpt_oss --mxfp4`: a synthetic gpt-oss checkpoint with its experts stored as the
released checkpoints store them: MXFP4 codes and scales (`gate_up_proj_blocks` [E, 2I, H/32, 16],
`gate_up_proj_scales` [E, 2I, H/32], the same for `down_proj` with a row per output), the biases
in bf16, and `quantization_config` naming the method and the modules left unquantized.

It rewrites a checkpoint synth has written, one safetensors file at a time, so the largest
tensor held at once is one layer's experts.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from freetoken.quant.mxfp4 import BLOCK, quantize_mxfp4

INDEX_FILE = "model.safetensors.index.json"
# what the released checkpoints' quantization_config leaves in bf16
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def convert_experts_to_mxfp4(checkpoint: str | Path) -> None:
    """Replace every `mlp.experts.gate_up_proj` / `down_proj` of a gpt-oss checkpoint directory with
    its MXFP4 blocks and scales, and mark the config."""
    root = Path(checkpoint)
    config_path = root / "config.json"
    config = json.loads(config_path.read_text())
    if config.get("model_type") != "gpt_oss":
        raise ValueError(f"--mxfp4 applies to gpt_oss checkpoints, not {config.get('model_type')!r}")
    if config["hidden_size"] % BLOCK or config["intermediate_size"] % BLOCK:
        raise ValueError(f"--mxfp4 needs hidden and expert sizes that are multiples of {BLOCK}, got "
                         f"{config['hidden_size']} and {config['intermediate_size']}")
    index_path = root / INDEX_FILE
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    files = sorted({*index["weight_map"].values()}) if index else ["model.safetensors"]
    total_bytes = 0
    for file in files:
        tensors = load_file(root / file)
        converted = {}
        for name, tensor in tensors.items():
            if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                # stored [E, in, out]; MXFP4 keeps a row per output with blocks along the inputs
                blocks, scales = quantize_mxfp4(tensor.transpose(1, 2).contiguous())
                converted[name + "_blocks"], converted[name + "_scales"] = blocks, scales
            else:
                converted[name] = tensor
        save_file(converted, root / file, metadata={"format": "pt"})
        total_bytes += sum(t.nbytes for t in converted.values())
        if index:
            for name in tensors:
                if name + "_blocks" in converted:
                    del index["weight_map"][name]
                    index["weight_map"][name + "_blocks"] = index["weight_map"][name + "_scales"] = file
    if index:
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        index.setdefault("metadata", {})["total_size"] = total_bytes
        index_path.write_text(json.dumps(index, indent=2) + "\n")
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

