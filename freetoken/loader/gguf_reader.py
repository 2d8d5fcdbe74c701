"""Dense weights of a GGUF file under transformers' names, as the safetensors reader gives them.

`GgufTensorReader` has `loader/checkpoint.py`'s `TensorReader` interface (`has`, `get`,
`optional`, `stored_dtype`, `file_of`; `get_packed` for MXFP4 codes), so `load_weights` and the
expert formats read a GGUF model unchanged. Tensors are converted to the dtype asked for:
bf16/f16/f32 exactly, the quantized types through `gguf.quants.dequantize` (the format's
reference). The routed experts of a `stacked` row appear under their fused names
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) and are served only
when stored unquantized; a quantized expert pool reads their raw blocks through
`GgufFile.expert_tensor` instead. gpt-oss's MXFP4 experts appear as a released checkpoint names
them (`*_blocks`, `*_scales`, `*_bias`: loader/gguf_mxfp4.py).
"""

from __future__ import annotations

import re

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from freetoken.errors import CheckpointError
from freetoken.loader.gguf_arch import EXPERT_TENSOR, FUSED_EXPERT_TENSORS, arch_of, tensor_names
from freetoken.loader.gguf_file import GgufFile, type_name
from freetoken.loader.gguf_mxfp4 import Mxfp4ExpertTensors

T = GGMLQuantizationType
FLOAT_TYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
QUANTIZED_TYPES = (T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
SUPPORTED_TYPES = (*FLOAT_TYPES, *QUANTIZED_TYPES)
_FUSED = [(re.compile("^" + re.escape(k).replace(r"\{n\}", r"(\d+)") + "$"), projs)
          for k, projs in FUSED_EXPERT_TENSORS.items()]


class GgufTensorReader:
    """Reads a GGUF model's tensors by transformers name, checking shapes and types."""

    def __init__(self, gguf: GgufFile) -> None:
        self.gguf = gguf
        self.dir = gguf.path  # where errors say the tensors are (TensorReader's attribute)
        self.row = arch_of(gguf)
        self._names = tensor_names(gguf, self.row)
        layers = int(gguf.get(f"{self.row.gguf_name}.block_count"))
        self.mxfp4 = Mxfp4ExpertTensors(gguf, layers, FLOAT_TYPES) if self.row.experts == "mxfp4" else None
        for n in range(layers if self.mxfp4 is None else 0):
            for fused, projs in FUSED_EXPERT_TENSORS.items():
                parts = [EXPERT_TENSOR.format(n=n, proj=p) for p in projs]
                if all(gguf.has_tensor(p) for p in parts):
                    self._names[fused.format(n=n)] = parts[0]
        experts = {} if self.mxfp4 is None else self.mxfp4.names
        # transformers name -> the file holding it (TensorReader's mapping, which callers scan)
        self.file_of = {name: gguf.entry(g).part.name for name, g in {**self._names, **experts}.items()}

    def has(self, name: str) -> bool:
        return name in self.file_of

    def get_packed(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """MXFP4 codes or scales of gpt-oss's experts (loader/gguf_mxfp4.py), uint8."""
        if self.mxfp4 is None:
            raise CheckpointError(f"{self.gguf.path}: tensor {name!r} is missing (no MXFP4 experts here)")
        return self.mxfp4.get_packed(name, shape)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.mxfp4 is not None and name in self.mxfp4.names:
            return self.mxfp4.get(name, shape, dtype)
        fused = self._fused_parts(name)
        if fused is not None:
            quantized = [p for p in fused if self.gguf.entry(p).type not in FLOAT_TYPES]
            if quantized:
                raise CheckpointError(
                    f"{self.gguf.path}: tensor {quantized[0]!r} is stored as "
                    f"{type_name(self.gguf.entry(quantized[0]).type)}: quantized experts are not converted to "
                    "float banks; a quantized expert pool reads their blocks (GgufFile.expert_tensor)"
                )
            rows = shape[1] // len(fused)  # gate_up_proj: gate's I rows, then up's
            return torch.cat([self._read(p, shape, dtype, shape[0], rows) for p in fused], 1)
        gguf_name = self._names.get(name)
        if gguf_name is None:
            raise CheckpointError(f"{self.gguf.path}: tensor {name!r} is missing (GGUF name for it not found)")
        return self._read(gguf_name, shape, dtype)

    def optional(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        return self.get(name, shape, dtype) if self.has(name) else None

    def stored_dtype(self, name: str) -> torch.dtype | None:
        """The torch dtype a tensor is stored in (None: a quantized type)."""
        if self.mxfp4 is not None and name in self.mxfp4.names:
            return self.mxfp4.stored_dtype(name)
        gguf_name = self._names.get(name)
        if gguf_name is None:
            raise CheckpointError(f"{self.gguf.path}: tensor {name!r} is missing")
        types = {self.gguf.entry(p).type for p in (self._fused_parts(name) or [gguf_name])}
        dtypes = {FLOAT_TYPES.get(t) for t in types}
        return dtypes.pop() if len(dtypes) == 1 else None

    def _fused_parts(self, name: str) -> list[str] | None:
        for pattern, projs in _FUSED:
            m = pattern.match(name)
            if m is not None and name in self._names:
                return [EXPERT_TENSOR.format(n=m[1], proj=p) for p in projs]
        return None

    def _read(self, gguf_name: str, shape: tuple[int, ...], dtype: torch.dtype,
              experts: int | None = None, rows: int | None = None) -> torch.Tensor:
        """One GGUF tensor as `shape` in `dtype`; an expert part is [experts, rows, shape[-1]]."""
        t = self.gguf.entry(gguf_name)
        want = (experts, rows, shape[-1]) if experts is not None else tuple(shape)
        if t.shape != want:
            raise CheckpointError(f"{t.part}: tensor {gguf_name!r} has shape {list(t.shape)}, expected {list(want)}")
        return dequantized(t.type, t.raw, t.shape, dtype, where=f"{t.part}: tensor {gguf_name!r}")


def dequantized(ggml_type: int, raw: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype,
                where: str = "tensor") -> torch.Tensor:
    """Raw GGUF bytes [*shape[:-1], row_bytes] as a tensor of `shape` in `dtype` (a new copy,
    never a view of the mapped file)."""
    if ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(type_name(t) for t in SUPPORTED_TYPES)
        raise CheckpointError(f"{where} is stored as {type_name(ggml_type)}; supported: {supported}")
    if ggml_type in FLOAT_TYPES:
        stored = FLOAT_TYPES[T(ggml_type)]
        # a copy of the bytes first: the mapped file is read-only and torch must own the result
        bits = torch.from_numpy(np.array(raw, copy=True)).view(stored).reshape(shape)
        return bits.to(dtype)
    values = dequantize(np.asarray(raw), T(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape).to(dtype)
