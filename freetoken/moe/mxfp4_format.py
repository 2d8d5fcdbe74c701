"""gpt-oss's MXFP4 experts kept as the checkpoint stores them: the codes and scales of every
block (quant/mxfp4.py) and the biases, as bytes in the host pool and in the device slots.

Shape legend: E experts, H hidden, I expert intermediate, G = columns / 32 blocks per row.
An expert is two flat byte rows, each a projection's tensors copied as they are:
    w13 [F, bytes]  gate_up_proj_blocks [2I, G_H, 16], gate_up_proj_scales [2I, G_H], gate_up_proj_bias [2I]
    w2  [F, bytes]  down_proj_blocks [H, G_I, 16], down_proj_scales [H, G_I], down_proj_bias [H]
then zeros up to a multiple of 16 bytes. Rows are the projection's outputs and blocks run along
its inputs; gate_up's rows interleave gate and up (row 2i gate i, row 2i+1 up i), as the
checkpoint has them. The biases keep the checkpoint's dtype (bf16 in the released checkpoints),
so an expert is 4.25 bits per weight plus its biases, ~3.8 times fewer bytes than bf16.

The device computes from the slots' blocks, two ways. `--moe-gemm torch` (and `auto`, on every
device): each routed slot is dequantized (exactly: every MXFP4 value is a bf16 value) into the
biased rows of moe/biased_expert_format.py, then the torch expert loop runs the clamped SwiGLU,
so the result is bit for bit that of a pool dequantized at load. `--moe-gemm triton`: the MXFP4
slot GEMM (kernels/triton/mxfp4_moe_gemm.py) decodes the blocks inside its kernels and keeps fp32
from the products to one rounding at the end, within the tolerance its pair states
(kernels/specs/mxfp4.py) of the fp32 loop, not bit for bit the torch path; it is not yet measured
on a GPU, so `auto` does not choose it. The CPU kernel (kernels/cpu/mxfp4_experts.py) reads the
same bytes, so the policies that compute experts on the CPU (cpu, hybrid, static) run these experts.
Long prefill chunks (`prefill_gemm`, either `--moe-gemm`) take neither: their routed slots are
dequantized a group at a time for grouped GEMMs, within the final sum's rounding of the torch loop.
Dequantizing (`ProjectionRows.dequantize`, both paths) is `dequantize_mxfp4`'s torch ops off CUDA
and its Triton twin on CUDA (kernels/triton/mxfp4_dequant.py: the same bits, one pass that reads
the codes and scales and writes the values, where the torch ops move ~40 bytes a weight).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from freetoken.config import ModelConfig
from freetoken.errors import CheckpointError
from freetoken.models.family import layer_prefix
from freetoken.moe import slot_gemm
from freetoken.moe.biased_expert_format import biased_bank_expert
from freetoken.moe.expert_format import Bank
from freetoken.moe.grouped_biased_gemm import grouped_biased_gemm
from freetoken.moe.slot_gemm import GemmFn
from freetoken.quant.mxfp4 import BLOCK, BLOCK_BYTES, dequantize_mxfp4

PROJECTIONS = ("gate_up_proj", "down_proj")
# A long prefill chunk's routed slots are dequantized a group at a time, at most this many bytes
# of experts in the activation dtype: 21 of gpt-oss-120b's in bf16 (~50 MB each), where its
# whole layer would be ~6.4 GB. On CUDA the Triton kernel writes the values and nothing else
# (plus the gathered slots' bytes, ~0.27x this); the torch ops elsewhere hold int64 codes and
# fp32 values, ~13 bytes a value, while a group's gate_up rows are dequantized: briefly ~4x this.
PREFILL_GROUP_BYTES = 1 << 30


@dataclass(frozen=True)
class ProjectionRows:
    """Where one projection's tensors lie in an expert's byte row."""

    rows: int  # outputs
    columns: int  # inputs, a multiple of 32
    bias_itemsize: int

    @property
    def groups(self) -> int:
        return self.columns // BLOCK

    @property
    def scales_at(self) -> int:
        return self.rows * self.groups * BLOCK_BYTES

    @property
    def bias_at(self) -> int:
        return self.scales_at + self.rows * self.groups

    @property
    def end(self) -> int:
        return self.bias_at + self.rows * self.bias_itemsize

    def unpack(self, row: torch.Tensor, bias_dtype: torch.dtype,
               with_bias: bool = True) -> tuple[torch.Tensor, ...]:
        """row uint8 [S, >= end] -> (blocks [S, rows, G, 16], scales [S, rows, G], bias [S, rows]),
        views of row but the bias (None without with_bias: row may then end at bias_at)."""
        S = row.shape[0]
        blocks = row[:, : self.scales_at].reshape(S, self.rows, self.groups, BLOCK_BYTES)
        scales = row[:, self.scales_at : self.bias_at].reshape(S, self.rows, self.groups)
        bias = row[:, self.bias_at : self.end].contiguous().view(bias_dtype) if with_bias else None
        return blocks, scales, bias

    def dequantize(self, bank: torch.Tensor, slots: torch.Tensor | slice, bias_dtype: torch.dtype,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """bank uint8 [E, >= end], slots (int64 [S] on its device, or a slice) -> (weights [S, rows,
        columns], bias [S, rows]) in `dtype`, exactly. On CUDA the Triton kernel reads the slots'
        codes and scales in place in the bank (the same bits, without gathering them first or the
        torch ops' temporaries); only the biases are gathered."""
        if bank.is_cuda and isinstance(slots, torch.Tensor):
            from freetoken.kernels.triton.mxfp4_dequant import dequantize_mxfp4_triton

            blocks, scales, _ = self.unpack(bank[:, : self.bias_at], bias_dtype, with_bias=False)
            bias = bank[slots, self.bias_at : self.end].view(bias_dtype)
            return dequantize_mxfp4_triton(blocks, scales, dtype, picked=slots), bias.to(dtype)
        blocks, scales, bias = self.unpack(bank[slots], bias_dtype)
        if blocks.is_cuda:
            from freetoken.kernels.triton.mxfp4_dequant import dequantize_mxfp4_triton

            return dequantize_mxfp4_triton(blocks, scales, dtype), bias.to(dtype)
        return dequantize_mxfp4(blocks, scales, dtype), bias.to(dtype)


@dataclass(frozen=True)
class Mxfp4ExpertFormat:
    hidden: int
    inter: int
    bias_dtype: torch.dtype
    cpu_executable: bool = True  # kernels/cpu/mxfp4_experts.py

    name = "mxfp4+bias"
    summary = "MXFP4 blocks with biases and the clamped SwiGLU (gpt-oss), kept quantized in the pool and the slots"

    @property
    def gate_up(self) -> ProjectionRows:
        return ProjectionRows(2 * self.inter, self.hidden, self.bias_dtype.itemsize)

    @property
    def down(self) -> ProjectionRows:
        return ProjectionRows(self.hidden, self.inter, self.bias_dtype.itemsize)

    def banks(self, config: ModelConfig) -> tuple[Bank, ...]:
        return (Bank("w13", (_aligned(self.gate_up.end),), torch.uint8),
                Bank("w2", (_aligned(self.down.end),), torch.uint8))

    def slot_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        return torch.uint8  # slots hold the blocks, never a dequantized copy

    def expert_bytes(self, config: ModelConfig) -> int:
        return sum(int(np.prod(b.row_shape)) for b in self.banks(config))

    def slot_bytes(self, config: ModelConfig, compute_dtype: torch.dtype) -> int:
        """One device slot's bytes."""
        return self.expert_bytes(config)

    def read_layer(self, reader, config: ModelConfig, layer: int, out: tuple[torch.Tensor, ...]) -> None:
        """Copy one layer's blocks, scales and biases into its rows: out = (w13, w2) uint8 [E, bytes]."""
        E = config.num_experts
        base = f"{layer_prefix(layer)}mlp.experts."
        for bank, name, proj in zip(out, PROJECTIONS, (self.gate_up, self.down), strict=True):
            bank[:, : proj.scales_at] = reader.get_packed(
                base + name + "_blocks", (E, proj.rows, proj.groups, BLOCK_BYTES)).reshape(E, -1)
            bank[:, proj.scales_at : proj.bias_at] = reader.get_packed(
                base + name + "_scales", (E, proj.rows, proj.groups)).reshape(E, -1)
            bias = reader.get(base + name + "_bias", (E, proj.rows), self.bias_dtype)
            bank[:, proj.bias_at : proj.end] = bias.contiguous().view(torch.uint8).reshape(E, -1)

    def expert_weights(self, w13: torch.Tensor, w2: torch.Tensor, slots: slice,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots' experts dequantized into the biased rows the loop computes with:
        (w13 [S, 2I, H+1] gate rows, then up rows, the bias last; w2 [S, H, I+1]) in `dtype`."""
        H, I = self.hidden, self.inter
        gate_up, bias = self.gate_up.dequantize(w13, slots, self.bias_dtype, dtype)  # gate and up interleaved
        biased13 = torch.empty(gate_up.shape[0], 2 * I, H + 1, dtype=dtype, device=w13.device)
        biased13[:, :I, :H], biased13[:, I:, :H] = gate_up[:, 0::2], gate_up[:, 1::2]
        biased13[:, :I, H], biased13[:, I:, H] = bias[:, 0::2], bias[:, 1::2]
        down, bias = self.down.dequantize(w2, slots, self.bias_dtype, dtype)
        return biased13, torch.cat((down, bias[..., None]), dim=-1)

    @staticmethod
    def auto_gemm(device: str) -> str:
        """`--moe-gemm auto`: the Triton kernel on CUDA (it decodes the blocks in place; the torch
        loop dequantizes every routed slot first, and reads its routes on the host, so decode
        cannot run in graphs), the loop elsewhere."""
        return "triton" if device == "cuda" else "torch"

    def slot_gemm(self, kind: str, layer: int) -> GemmFn:
        """The decode GEMM over slots: "torch" (dequantize each routed slot, then the expert loop:
        bit for bit the dequantized pool's) or "triton" (kernels/triton/mxfp4_moe_gemm.py, the
        blocks decoded in the kernel, fp32 to one rounding)."""
        if kind == "triton":
            from freetoken.kernels.triton.mxfp4_moe_gemm import mxfp4_slots_gemm

            return partial(_triton_gemm, mxfp4_slots_gemm, self.hidden, self.inter, self.bias_dtype)
        if kind != "torch":
            raise CheckpointError(f"--moe-gemm {kind}: MXFP4 experts ({self.name}) are computed by the torch "
                                  "loop or the Triton kernel: use --moe-gemm torch, triton or auto")
        return partial(_torch_gemm, self)

    def prefill_gemm(self, layer: int) -> GemmFn:
        """The GEMM of long prefill chunks (streamed or resident layers): the routed slots
        dequantized a group at a time, at most PREFILL_GROUP_BYTES of them, and each group's
        pairs computed by two grouped GEMMs (moe/grouped_biased_gemm.py). The loop launches ~25
        kernels per expert from Python, 128 experts a layer at gpt-oss's sizes; a whole layer
        dequantized at once would be ~6.4 GB at gpt-oss-120b's. Within the final sum's rounding
        of the loop: a token's K terms are summed in fp32 and rounded once. CUDA's grouped GEMM
        takes bf16 only: other dtypes on CUDA run the loop."""
        return partial(_grouped_gemm, self)

    def cpu_banks(self, banks: tuple[torch.Tensor, ...]) -> tuple[np.ndarray, ...]:
        """The banks as the CPU kernel reads them (kernels/cpu/mxfp4_experts.py): the same bytes."""
        return tuple(bank.numpy() for bank in banks)

    def cpu_layout(self, config: ModelConfig):
        """What the CPU kernel needs beyond the banks: how the biases are stored, and the sizes."""
        from freetoken.kernels.cpu.mxfp4_experts import BIAS_BF16, BIAS_FP32, Mxfp4Layout

        code = {torch.bfloat16: BIAS_BF16, torch.float32: BIAS_FP32}[self.bias_dtype]
        return Mxfp4Layout(code, config.num_experts, self.hidden, self.inter)


def _aligned(nbytes: int) -> int:
    """Rows start 16 bytes apart, so the fill and the kernels load whole vectors."""
    return -(-nbytes // 16) * 16


def _triton_gemm(kernel, hidden, inter, bias_dtype, x, weights, routes, w13, w2, landing=None):
    return kernel(x, weights, routes, w13, w2, hidden, inter, bias_dtype, landing=landing)


def _torch_gemm(fmt: Mxfp4ExpertFormat, x, weights, routes, w13, w2, landing=None):
    def one(slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, down = fmt.expert_weights(w13, w2, slice(slot, slot + 1), x.dtype)
        return gate_up[0], down[0]

    return slot_gemm.expert_loop(x, weights, routes, w13.shape[0], one, biased_bank_expert)


def _grouped_gemm(fmt: Mxfp4ExpertFormat, x, weights, routes, w13, w2):
    if x.is_cuda and x.dtype != torch.bfloat16:
        return _torch_gemm(fmt, x, weights, routes, w13, w2)
    slot_bytes = 3 * fmt.hidden * fmt.inter * x.element_size()  # one expert dequantized, both projections
    return grouped_biased_gemm(
        x, weights, routes, w13.shape[0], max(1, PREFILL_GROUP_BYTES // slot_bytes),
        lambda slots: fmt.gate_up.dequantize(w13, slots, fmt.bias_dtype, x.dtype),
        lambda slots: fmt.down.dequantize(w2, slots, fmt.bias_dtype, x.dtype))


def mxfp4_format_for(reader, config: ModelConfig) -> Mxfp4ExpertFormat | None:
    """The format of a checkpoint whose experts are MXFP4 (`*_blocks`, `*_scales`; a GGUF file's
    are read under those names, loader/gguf_mxfp4.py), or None when they are stored as floats.
    Refuses what the format cannot hold."""
    sparse = [i for i in range(config.num_layers) if config.sparse_layers[i]]
    prefixes = [f"{layer_prefix(i)}mlp.experts." for i in sparse]
    quantized = {reader.has(p + name + "_blocks") for p in prefixes for name in PROJECTIONS}
    if quantized == {False}:
        return None
    if quantized == {True, False}:
        raise CheckpointError("the experts mix MXFP4 and unquantized tensors; not supported")
    if not (config.expert_bias and config.expert_activation == "clamped_swiglu"):
        raise CheckpointError(f"{config.arch}: MXFP4 experts are read for gpt-oss's biased, clamped-SwiGLU "
                              "experts only")
    H, I = config.hidden_size, config.moe_intermediate_size
    if H % BLOCK or I % BLOCK:
        raise CheckpointError(f"MXFP4 experts need hidden and expert sizes that are multiples of {BLOCK}, got {H}, {I}")
    bias_dtypes = {reader.stored_dtype(p + name + "_bias") for p in prefixes for name in PROJECTIONS}
    if len(bias_dtypes) != 1 or None in bias_dtypes:
        raise CheckpointError(f"MXFP4 experts' biases are stored in {sorted(map(str, bias_dtypes))}: one float "
                              "dtype is needed")
    # (fp16 biases are kept widened to fp32, exactly: the CPU kernel reads fp32 or bf16 ones)
    bias_dtype = bias_dtypes.pop()
    return Mxfp4ExpertFormat(H, I, torch.float32 if bias_dtype == torch.float16 else bias_dtype)
