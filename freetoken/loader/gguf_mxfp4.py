"""gpt-oss's MXFP4 experts of a GGUF file, read under the names and in the layout of a released
safetensors checkpoint, so moe/mxfp4_format.py keeps them as it keeps a checkpoint's.

Shape legend: E experts, H hidden, I expert intermediate, G = columns / 32.
The file's `blk.N.ffn_{gate,up,down}_exps.weight` [E, rows, cols] are GGML MXFP4 blocks (17
bytes per 32 values) and `.bias` [E, rows] floats; served as
    model.layers.N.mlp.experts.gate_up_proj_{blocks,scales,bias}  [E, 2I, G_H, 16], [E, 2I, G_H], [E, 2I]
    model.layers.N.mlp.experts.down_proj_{blocks,scales,bias}     [E, H, G_I, 16], [E, H, G_I], [E, H]
with gate and up interleaved again (row 2i gate i, row 2i+1 up i) and every block's codes
moved into the checkpoint's order (quant/mxfp4.py): a permutation of bytes and nibbles, so the
values are the file's exactly. Experts are read one at a time with file reads (GgufFile's
`read_slice_into`); the scales of a projection come out of the pass that makes its blocks and
wait, small, for the caller that asks for them next.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from freetoken.errors import CheckpointError
from freetoken.loader.gguf_file import GgufFile, type_name
from freetoken.quant.ggml_blocks import GGMLType
from freetoken.quant.mxfp4 import BLOCK, BLOCK_BYTES, GGML_BLOCK_BYTES, ggml_to_checkpoint

# the checkpoint's projection -> the GGUF projections interleaved into its rows
PROJECTIONS = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
_NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales|bias)$")


class Mxfp4ExpertTensors:
    """The experts of every layer of `gguf`, by the checkpoint's names. CheckpointError at once
    when an expert tensor is missing or not MXFP4 (its biases not floats)."""

    def __init__(self, gguf: GgufFile, layers: int, float_types: dict) -> None:
        self.gguf = gguf
        self._float_types = float_types  # GGML float type -> torch dtype (the reader's)
        self._pending: dict[str, torch.Tensor] = {}  # scales made beside blocks, not yet asked for
        self.names: dict[str, str] = {}  # checkpoint name -> the GGUF tensor it starts from
        for n in range(layers):
            for proj, parts in PROJECTIONS.items():
                for part in parts:
                    weight, bias = (f"blk.{n}.ffn_{part}_exps.{k}" for k in ("weight", "bias"))
                    if gguf.entry(weight).type != GGMLType.MXFP4:
                        raise CheckpointError(f"{gguf.path}: tensor {weight!r} is stored as "
                                              f"{type_name(gguf.entry(weight).type)}; gpt-oss experts are read as "
                                              "MXFP4 (as released) only")
                    if gguf.entry(bias).type not in float_types:
                        raise CheckpointError(f"{gguf.path}: tensor {bias!r} is stored as "
                                              f"{type_name(gguf.entry(bias).type)}; expert biases are read as floats")
                base = f"model.layers.{n}.mlp.experts.{proj}"
                first = f"blk.{n}.ffn_{parts[0]}_exps."
                self.names.update({base + "_blocks": first + "weight", base + "_scales": first + "weight",
                                   base + "_bias": first + "bias"})

    def get_packed(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """`_blocks` or `_scales` of a projection, uint8, checked against `shape`."""
        layer, proj, kind = self._parse(name)
        if kind == "bias":
            raise CheckpointError(f"{self.gguf.path}: {name!r} holds floats, not packed codes")
        if name in self._pending:
            out = self._pending.pop(name)
        else:
            blocks, scales = self._repack(layer, proj)
            if kind == "blocks":
                out, self._pending[name.removesuffix("_blocks") + "_scales"] = blocks, scales
            else:
                out = scales  # (the blocks, large, are made again if asked for)
        if tuple(out.shape) != tuple(shape):
            raise CheckpointError(f"{self.gguf.path}: {name!r} has shape {list(out.shape)}, expected {list(shape)}")
        return out

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A projection's biases [E, rows] in `dtype` (gate and up interleaved)."""
        layer, proj, kind = self._parse(name)
        if kind != "bias":
            raise CheckpointError(f"{self.gguf.path}: {name!r} holds MXFP4 codes: read it packed")
        parts = [self._bias(f"blk.{layer}.ffn_{p}_exps.bias") for p in PROJECTIONS[proj]]
        out = torch.stack(parts, dim=-1).reshape(parts[0].shape[0], -1)  # [E, rows]: part after part per row
        if tuple(out.shape) != tuple(shape):
            raise CheckpointError(f"{self.gguf.path}: {name!r} has shape {list(out.shape)}, expected {list(shape)}")
        return out.to(dtype)

    def stored_dtype(self, name: str) -> torch.dtype | None:
        """The biases' float dtype; None for the packed codes."""
        return self._float_types[self.gguf.entry(self.names[name]).type] if name.endswith("_bias") else None

    def _parse(self, name: str) -> tuple[int, str, str]:
        m = _NAME.match(name)
        if m is None or name not in self.names:
            raise CheckpointError(f"{self.gguf.path}: tensor {name!r} is missing")
        return int(m[1]), m[2], m[3]

    def _bias(self, gguf_name: str) -> torch.Tensor:
        t = self.gguf.entry(gguf_name)
        bits = torch.from_numpy(np.array(t.raw, copy=True)).view(self._float_types[t.type])
        return bits.reshape(t.shape)

    def _repack(self, layer: int, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(blocks [E, rows, G, 16], scales [E, rows, G]) of a projection, expert by expert."""
        parts = PROJECTIONS[proj]
        names = [f"blk.{layer}.ffn_{p}_exps.weight" for p in parts]
        entries = [self.gguf.entry(n) for n in names]
        E, rows, cols = entries[0].shape
        if cols % BLOCK or any(e.shape != entries[0].shape for e in entries):
            raise CheckpointError(f"{self.gguf.path}: MXFP4 experts {names} have shapes "
                                  f"{[list(e.shape) for e in entries]}: gate and up alike, rows of whole blocks")
        G = cols // BLOCK
        blocks = torch.empty(E, rows * len(parts), G, BLOCK_BYTES, dtype=torch.uint8)
        scales = torch.empty(E, rows * len(parts), G, dtype=torch.uint8)
        raw = np.empty((rows, G, GGML_BLOCK_BYTES), dtype=np.uint8)
        for e in range(E):
            for k, name in enumerate(names):
                self.gguf.read_slice_into(name, e, raw)
                b, s = ggml_to_checkpoint(torch.from_numpy(raw))
                blocks[e, k :: len(parts)], scales[e, k :: len(parts)] = b, s
        return blocks, scales
