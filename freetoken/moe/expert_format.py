"""Expert formats: how one expert's weights are stored, in the host pool and in the device slots.

A format fixes, for every bank of an expert: its name, element dtype and row shape (the host pool
and the slots share the layout, so a slot fill is a byte copy of one row per bank); hence the
bytes per expert. It says how a checkpoint's tensors are read into those rows, which GEMM over
slots computes with them on the device (and its pure-Python twin with the twin's tolerance, in
kernels/registry.py), and whether the CPU expert kernel can compute with them.

Adding a format (a quantized one) adds an entry here with its kernels; the engine asks this
table and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from freetoken.config import ModelConfig
from freetoken.loader.checkpoint import TensorReader, read_expert_banks
from freetoken.moe import slot_gemm
from freetoken.moe.slot_gemm import GemmFn


@dataclass(frozen=True)
class Bank:
    name: str
    row_shape: tuple[int, ...]  # one expert's rows in this bank
    dtype: torch.dtype


@dataclass(frozen=True)
class ExpertFormat:
    """An unquantized format: gate and up rows stacked in w13 [2I, H], down in w2 [H, I]."""

    name: str
    dtype: torch.dtype
    cpu_executable: bool  # the CPU expert kernel (kernels/cpu/experts.py) reads these banks
    summary: str

    def banks(self, config: ModelConfig) -> tuple[Bank, ...]:
        H, I = config.hidden_size, config.moe_intermediate_size
        return Bank("w13", (2 * I, H), self.dtype), Bank("w2", (H, I), self.dtype)

    def expert_bytes(self, config: ModelConfig) -> int:
        return sum(int(np.prod(b.row_shape)) * b.dtype.itemsize for b in self.banks(config))

    def slot_bytes(self, config: ModelConfig, compute_dtype: torch.dtype) -> int:
        """One device slot's bytes."""
        return sum(int(np.prod(b.row_shape)) for b in self.banks(config)) * self.slot_dtype(compute_dtype).itemsize

    def read_layer(self, reader: TensorReader, config: ModelConfig, layer: int, out: tuple[torch.Tensor, ...]) -> None:
        """Read one layer's experts from the checkpoint into `out` (its rows of every bank)."""
        read_expert_banks(reader, config, layer, self.dtype, out=out)

    def slot_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """The slots hold the experts in the compute dtype (a fill widens bf16 rows where it differs)."""
        return compute_dtype

    @staticmethod
    def auto_gemm(device: str) -> str:
        """`--moe-gemm auto`: the fused kernel on CUDA, its twin elsewhere."""
        return "triton" if device == "cuda" else "torch"

    def slot_gemm(self, kind: str, layer: int) -> GemmFn:
        """The decode GEMM over slots (every layer the same): "triton" (the fused kernel) or
        "torch" (its exact twin)."""
        return {"triton": slot_gemm.triton_slots_gemm, "torch": slot_gemm.torch_slots_gemm}[kind]

    @staticmethod
    def prefill_gemm(layer: int) -> GemmFn:
        """The GEMM over a streamed layer's experts for long prefill chunks."""
        return slot_gemm.grouped_slots_gemm

    def cpu_refusal(self, policy: str, dtype: str) -> str:
        """Why a policy that computes experts on the CPU cannot run this format (`dtype`: the compute dtype)."""
        return (f"policy {policy!r} computes experts on the CPU from bf16 banks, which would round the "
                f"{self.name} experts this checkpoint stores and --dtype {dtype} computes "
                "with; use --moe-policy resident or transfer, or --dtype bfloat16")

    def cpu_banks(self, banks: tuple[torch.Tensor, ...]) -> tuple[np.ndarray, ...]:
        """The banks as the CPU kernel takes them: bf16 bits as uint16 arrays sharing memory."""
        if not self.cpu_executable:
            raise ValueError(f"the CPU expert kernel does not compute {self.name} experts")
        return tuple(bank.view(torch.int16).numpy().view("uint16") for bank in banks)

    @staticmethod
    def cpu_layout(config: ModelConfig) -> None:
        """The CPU kernel reads everything it needs of bf16 banks from their shapes."""
        return None


BF16 = ExpertFormat("bf16", torch.bfloat16, cpu_executable=True, summary="bfloat16 weights, as checkpoints ship")
# The compute dtype's own width, for checkpoints whose experts bf16 would round in an fp32 or
# fp16 engine (the reference computes those unrounded); only the device computes them.
FLOAT32 = ExpertFormat("fp32", torch.float32, cpu_executable=False, summary="float32 weights, device only")
FLOAT16 = ExpertFormat("fp16", torch.float16, cpu_executable=False, summary="float16 weights, device only")
FORMATS = {f.name: f for f in (BF16, FLOAT32, FLOAT16)}


def format_for(reader: TensorReader, compute_dtype: torch.dtype) -> ExpertFormat:
    """bf16 when the engine computes in bf16 or the checkpoint stores every expert tensor in bf16
    (then bf16 banks hold exactly what the compute dtype would read), else the compute dtype's:
    an fp32 checkpoint computed in fp32 but rounded to bf16 banks would move logits by far more
    than fp32 rounding does."""
    if compute_dtype == torch.bfloat16:
        return BF16
    # MXFP4 codes and scales (gpt-oss) dequantize to values bf16 holds exactly
    stored = {reader.stored_dtype(name) for name in reader.file_of
              if ".experts." in name and not name.endswith(("_blocks", "_scales"))}
    return BF16 if stored == {torch.bfloat16} else format_of(compute_dtype)


def format_of(dtype: torch.dtype) -> ExpertFormat:
    """The unquantized format whose banks hold `dtype`."""
    return next(f for f in FORMATS.values() if f.dtype == dtype)
