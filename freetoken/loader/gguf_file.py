"""A GGUF model file, memory-mapped: its metadata and its tensors' raw bytes.

Shape legend (GGUF's `ne` lists dimensions innermost first; here shapes are outermost first, as
numpy and torch write them): a 2-D weight of `rows` output rows over `cols` inputs is ne = (cols,
rows) and is stored as `rows` rows of `row_bytes(type, cols)` bytes, each row `cols / block_elems`
consecutive blocks. An expert tensor `blk.N.ffn_{gate,up,down}_exps.weight` is ne = (cols, rows,
E): gate and up hold I rows of H inputs per expert, down H rows of I.

A model split by llama.cpp's tool is `NAME-00001-of-0000N.gguf` plus its siblings; opening the
first part opens all of them (every part must be there). Tensors are views of the mapped files:
nothing is read into RAM until a caller copies or converts it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from freetoken.errors import CheckpointError

_SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
EXPERT_PROJECTIONS = ("gate", "up", "down")


def row_bytes(ggml_type: int, cols: int) -> int:
    """Bytes of one row of `cols` elements stored as `ggml_type`."""
    block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if cols % block_elems:
        raise ValueError(f"a row of {cols} elements is not a whole number of {type_name(ggml_type)} blocks")
    return cols // block_elems * block_bytes


def type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"unknown type {ggml_type}"


def split_parts(path: Path) -> list[Path]:
    """Every file of the model `path` names: itself, or all parts of a split model when it is
    the first part (`-00001-of-0000N.gguf`)."""
    match = _SPLIT_NAME.match(path.name)
    if match is None:
        return [path]
    no, count = int(match["no"]), int(match["count"])
    if no != 1:
        raise CheckpointError(f"{path}: part {no} of a split model; pass its first part (-00001-of-{count:05d})")
    parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise CheckpointError(f"{path}: split model of {count} parts; missing: {', '.join(missing)}")
    return parts


class GgufTensor:
    """One tensor's place in a mapped file: its type, shape (outermost first) and raw bytes."""

    def __init__(self, part: Path, ggml_type: int, shape: tuple[int, ...], raw: np.ndarray, offset: int) -> None:
        self.part = part
        self.type = ggml_type
        self.shape = shape
        self.raw = raw  # uint8 [*shape[:-1], row_bytes(type, shape[-1])]
        self.offset = offset  # of its first byte in the part file


class GgufFile:
    """A GGUF model (one file or all parts of a split one), memory-mapped."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such GGUF file")
        self.parts = split_parts(self.path)
        readers = [self._open(p) for p in self.parts]
        self._fields = readers[0].fields  # every key lives in the first part; the others hold split.*
        self._tensors: dict[str, GgufTensor] = {}
        for part, reader in zip(self.parts, readers, strict=True):
            for t in reader.tensors:
                if t.name in self._tensors:
                    raise CheckpointError(f"{part}: tensor {t.name!r} is also in {self._tensors[t.name].part.name}")
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                raw = reader.data[t.data_offset : t.data_offset + t.n_bytes]
                byte_shape = (*shape[:-1], row_bytes(t.tensor_type, shape[-1]))
                self._tensors[t.name] = GgufTensor(part, int(t.tensor_type), shape, raw.reshape(byte_shape),
                                                   int(t.data_offset))
        self._check_split()

    @staticmethod
    def _open(part: Path) -> GGUFReader:
        try:
            return GGUFReader(part)
        except Exception as exc:  # the reader raises ValueError, struct errors, IndexError on bad files
            raise CheckpointError(f"{part}: not a readable GGUF file ({exc})") from exc

    def _check_split(self) -> None:
        count = self.get("split.count", None)
        if count is None:
            if len(self.parts) > 1:
                raise CheckpointError(f"{self.path}: named as a split model but has no split.count")
            return
        if int(count) != len(self.parts):
            raise CheckpointError(f"{self.path}: split.count is {count}, but the file name says {len(self.parts)}")
        total = self.get("split.tensors.count", None)
        if total is not None and int(total) != len(self._tensors):
            raise CheckpointError(
                f"{self.path}: split.tensors.count is {total}, but the {len(self.parts)} parts hold "
                f"{len(self._tensors)} tensors"
            )

    # -- metadata --------------------------------------------------------------------------

    _MISSING: Any = object()

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """A metadata value (a number, bool, string or list of them); without `default` a missing
        key is a CheckpointError naming it."""
        field = self._fields.get(key)
        if field is None:
            if default is self._MISSING:
                raise CheckpointError(f"{self.path}: metadata key {key!r} is missing")
            return default
        value = field.contents()
        kind = field.types[0] if field.types else None
        if kind == GGUFValueType.BOOL:
            return bool(value)
        if kind == GGUFValueType.FLOAT32:
            # The decimal the writer meant (1e-06, not 9.99999997e-07): a float32 field cannot hold
            # most decimals, and its shortest round-tripping decimal is the config value it came from.
            return float(str(np.float32(value)))
        return value

    def has(self, key: str) -> bool:
        return key in self._fields

    @property
    def keys(self) -> list[str]:
        return list(self._fields)

    @property
    def architecture(self) -> str:
        return self.get("general.architecture")

    # -- tensors ---------------------------------------------------------------------------

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def entry(self, name: str) -> GgufTensor:
        t = self._tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing")
        return t

    def tensor(self, name: str) -> tuple[int, np.ndarray, tuple[int, ...]]:
        """(GGML type id, raw uint8 bytes [*shape[:-1], row_bytes], shape outermost first): a view
        of the mapped file."""
        t = self.entry(name)
        return t.type, t.raw, t.shape

    def expert_tensor(self, layer: int, proj: str) -> tuple[int, np.ndarray]:
        """One layer's experts of one projection: (GGML type id, raw uint8 [E, rows, row_bytes]),
        a view of the mapped file. gate/up: I rows of H inputs; down: H rows of I."""
        if proj not in EXPERT_PROJECTIONS:
            raise ValueError(f"expert projection {proj!r}: expected one of {', '.join(EXPERT_PROJECTIONS)}")
        name = f"blk.{layer}.ffn_{proj}_exps.weight"
        t = self.entry(name)
        if len(t.shape) != 3:
            raise CheckpointError(f"{t.part}: tensor {name!r} has shape {t.shape}, expected [experts, rows, cols]")
        return t.type, t.raw

    def read_experts_into(self, layer: int, proj: str, out: np.ndarray, first: int = 0) -> None:
        """Copy expert e's bytes of `expert_tensor(layer, proj)` into out[e, first:first + its bytes]
        (out: uint8 [E, >= first + bytes], rows contiguous) with file reads, not through the mapping:
        pages of a mapping once read count in the process's resident memory until it is unmapped,
        which would hold a second copy of every expert while the pool is filled."""
        _, raw = self.expert_tensor(layer, proj)
        name = f"blk.{layer}.ffn_{proj}_exps.weight"
        per_expert = raw[0].nbytes
        if out.dtype != np.uint8 or out.shape[0] != raw.shape[0] or out.shape[1] < first + per_expert:
            raise ValueError(f"{self.entry(name).part}: {raw.shape[0]} experts of {per_expert} bytes do not fit "
                             f"uint8 {tuple(out.shape)} at column {first}")
        for e in range(raw.shape[0]):
            self.read_slice_into(name, e, out[e, first : first + per_expert])

    def read_slice_into(self, name: str, index: int, dest: np.ndarray) -> None:
        """Copy slice `index` of tensor `name`'s outermost axis (an expert of a stacked expert
        tensor) into `dest` (contiguous uint8 of exactly its bytes) with a file read (see
        `read_experts_into` for why not through the mapping)."""
        t = self.entry(name)
        size = t.raw[0].nbytes
        if dest.dtype != np.uint8 or dest.nbytes != size or not dest.flags.c_contiguous:
            raise ValueError(f"{t.part}: a slice of tensor {name!r} is {size} contiguous bytes, got "
                             f"{dest.dtype} {tuple(dest.shape)}")
        with open(t.part, "rb", buffering=0) as f:
            if os.preadv(f.fileno(), [memoryview(dest).cast("B")], t.offset + index * size) != size:
                raise CheckpointError(f"{t.part}: tensor {name!r} ends before its last byte (a truncated file?)")
