"""The host expert pool: every expert of every layer in host RAM, the source of truth.

Shape legend: L layers, E experts, I expert intermediate, H hidden; fid = layer * E + e.
    w13 [L*E, 2I, H] bf16 (or the compute dtype, below)   gate rows, then up rows
    w2  [L*E, H, I]  bf16 (or the compute dtype)

Banks are filled first and pinned afterwards (cudaHostRegister on the filled pages): pinning
while allocating costs far more. Pinned memory lets the slot fill run at PCIe speed and lets a
GPU kernel read the pool directly. The banks' layout is the pool's expert format
(moe/expert_format.py): bf16 wherever that rounds nothing the compute dtype would see.
A GGUF file's block-quantized experts keep their blocks (moe/block_format.py): two flat byte
rows per expert instead, as do gpt-oss's MXFP4 experts (moe/mxfp4_format.py); moe/formats.py
chooses. Fids of dense
(non-MoE) layers stay zero and are never routed.
"""

from __future__ import annotations

import weakref
from contextlib import ExitStack
from pathlib import Path

import torch

from freetoken.config import ModelConfig
from freetoken.loader.checkpoint import open_tensor_reader
from freetoken.moe.expert_format import ExpertFormat, format_of
from freetoken.moe.formats import expert_format_for
from freetoken.progress import Progress


class HostExpertPool:
    def __init__(self, config: ModelConfig, w13: torch.Tensor, w2: torch.Tensor,
                 expert_format: ExpertFormat | None = None) -> None:
        self.config = config
        self.format = expert_format or format_of(w13.dtype)
        self.w13 = w13  # [L*E, 2I, H]
        self.w2 = w2  # [L*E, H, I]
        self.pinned = False

    @property
    def expert_bytes(self) -> int:
        return (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes

    @classmethod
    def load(
        cls, model_dir: str | Path, config: ModelConfig, compute_dtype: torch.dtype = torch.bfloat16
    ) -> HostExpertPool:
        """model_dir: a checkpoint directory or a GGUF file. compute_dtype: the dtype the engine
        computes in (with the checkpoint, it decides the pool's expert format)."""
        with ExitStack() as stack:
            reader = open_tensor_reader(Path(model_dir), stack)
            return cls.read(reader, config, expert_format_for(reader, config, compute_dtype))

    @classmethod
    def read(cls, reader, config: ModelConfig, fmt) -> HostExpertPool:
        """Every sparse layer's experts from an open checkpoint, in `fmt`'s banks."""
        L, E = config.num_layers, config.num_experts
        w13, w2 = (torch.zeros(L * E, *bank.row_shape, dtype=bank.dtype) for bank in fmt.banks(config))
        sparse = [layer for layer in range(L) if config.sparse_layers[layer]]
        with Progress("read experts", len(sparse), unit="layers") as progress:
            for layer in sparse:
                rows = slice(layer * E, (layer + 1) * E)
                fmt.read_layer(reader, config, layer, out=(w13[rows], w2[rows]))
                progress.advance(1, f"layer {layer}")
        return cls(config, w13, w2, fmt)

    def pin(self) -> None:
        """Page-lock the banks in place so host-to-device copies run at full PCIe speed."""
        if self.pinned or not torch.cuda.is_available():
            return
        cudart = torch.cuda.cudart()
        # One cudaHostRegister per bank, each a long call: the bar moves by banks' bytes.
        with Progress("pin experts", self.nbytes, unit="B") as progress:
            for name, bank in (("w13", self.w13), ("w2", self.w2)):
                err = cudart.cudaHostRegister(bank.data_ptr(), bank.nbytes, 0)
                if int(err) != 0:
                    progress.write(f"[freetoken] warning: pinning {bank.nbytes / 1e9:.1f} GB of experts failed "
                                   f"({err}); copies will run at pageable speed")
                    return
                progress.advance(bank.nbytes, name)
        self.pinned = True
        # Unregister before the pages go back to the allocator, even if close() is never called:
        # a registered range that outlives its memory makes later registrations fail.
        self._finalizer = weakref.finalize(self, _unregister, [self.w13.data_ptr(), self.w2.data_ptr()])

    def unpin(self) -> None:
        if self.pinned:
            self._finalizer()
            self.pinned = False


def _unregister(pointers: list[int]) -> None:
    cudart = torch.cuda.cudart()
    for ptr in pointers:
        cudart.cudaHostUnregister(ptr)
