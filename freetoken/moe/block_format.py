"""Block-quantized experts: the GGML block formats (Q8_0, Q4_K, Q5_K, Q6_K) as GGUF files store
them, kept in those blocks in the host pool and in the device slots.

Shape legend: L layers, E experts, H hidden, I expert intermediate, F = L*E fids, S slots.
An expert is two flat byte rows, the file's blocks copied as they are:
    w13 [F, gu_bytes]  gate rows [I, row_bytes(gu, H)] then up rows [I, row_bytes(gu, H)]
    w2  [F, d_bytes]   down rows [H, row_bytes(d, I)], then zeros up to the widest layer's
Types are per layer (a Q4_K_M file gives some layers Q6_K down projections), so the banks are as
wide as the widest layer and every slot holds any layer's expert; a layer's kernels are compiled
for its own pair of types. Padding a narrower layer to the widest costs host memory and PCIe
bytes in proportion (`padding_share`).

Nothing is dequantized ahead of use: the decode GEMM over slots, the CPU kernel and the prefill
path read the blocks. Twins: `gguf`'s dequantization (bit-exact against ours) and the fp32
expert loop; tolerances stated by the kernels (kernels/registry.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from freetoken.config import ModelConfig
from freetoken.errors import CheckpointError
from freetoken.moe import slot_gemm
from freetoken.moe.expert_format import Bank, ExpertFormat
from freetoken.moe.slot_gemm import GemmFn
from freetoken.quant.ggml_blocks import GGMLType, dequantize, row_bytes

PROJECTIONS = ("gate", "up", "down")
# The types the block kernels compute (the rest of a GGUF's expert types are unquantized floats).
BLOCK_QUANT_TYPES = frozenset({GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K})


@dataclass(frozen=True)
class BlockQuantFormat:
    layer_types: tuple[tuple[GGMLType, GGMLType], ...]  # per layer: (gate/up type, down type)
    hidden: int
    inter: int
    cpu_executable: bool = True

    @property
    def name(self) -> str:
        used = sorted({t for pair in self.layer_types for t in pair}, key=int)
        return "+".join(t.name for t in used)

    @property
    def summary(self) -> str:
        return f"GGUF blocks ({self.name}), kept quantized in the pool and the slots"

    def gate_up_bytes(self, layer: int) -> int:
        """One expert's gate rows (or up rows) in `layer`."""
        return self.inter * row_bytes(self.layer_types[layer][0], self.hidden)

    def down_bytes(self, layer: int) -> int:
        return self.hidden * row_bytes(self.layer_types[layer][1], self.inter)

    def banks(self, config: ModelConfig) -> tuple[Bank, ...]:
        layers = range(len(self.layer_types))
        return (Bank("w13", (_aligned(max(2 * self.gate_up_bytes(i) for i in layers)),), torch.uint8),
                Bank("w2", (_aligned(max(self.down_bytes(i) for i in layers)),), torch.uint8))

    def slot_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        return torch.uint8  # slots hold the blocks, never a dequantized copy

    def expert_bytes(self, config: ModelConfig) -> int:
        return sum(int(np.prod(b.row_shape)) for b in self.banks(config))

    def slot_bytes(self, config: ModelConfig, compute_dtype: torch.dtype) -> int:
        """One device slot's bytes."""
        return sum(int(np.prod(b.row_shape)) for b in self.banks(config)) * self.slot_dtype(compute_dtype).itemsize

    def padding_share(self, config: ModelConfig, sparse_layers: list[int]) -> float:
        """The share of the banks' bytes that is padding (layers narrower than the widest)."""
        used = sum(2 * self.gate_up_bytes(i) + self.down_bytes(i) for i in sparse_layers)
        return 1 - used / (len(sparse_layers) * self.expert_bytes(config))

    def read_layer(self, source, config: ModelConfig, layer: int, out: tuple[torch.Tensor, ...]) -> None:
        """Copy one layer's blocks from a GGUF file (`source`: loader/gguf_reader.py's reader) into its
        rows of the banks: out = (w13 [E, gu_bytes], w2 [E, d_bytes]) uint8."""
        w13, w2 = (bank.numpy() for bank in out)
        gu = self.gate_up_bytes(layer)
        for proj, bank, first in (("gate", w13, 0), ("up", w13, gu), ("down", w2, 0)):
            qtype, _ = source.gguf.expert_tensor(layer, proj)
            expected = self.layer_types[layer][proj == "down"]
            if qtype != expected:
                raise CheckpointError(f"layer {layer} {proj} experts: stored as {GGMLType(qtype).name}, "
                                      f"the layer's format expects {expected.name}")
            source.gguf.read_experts_into(layer, proj, bank, first)

    def expert_weights(self, layer: int, w13: torch.Tensor, w2: torch.Tensor, slots: slice,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots' experts dequantized, two calls for the whole range: (w13 [S, 2I, H], w2 [S, H, I])
        in `dtype`."""
        gu, d = self.layer_types[layer]
        H, I = self.hidden, self.inter
        gate_up = w13[slots, : 2 * self.gate_up_bytes(layer)]  # [S, bytes]; a copy where rows are padded
        down = w2[slots, : self.down_bytes(layer)]
        S = gate_up.shape[0]
        return (dequantize_rows(gate_up.reshape(S * 2 * I, -1), gu, H, dtype).view(S, 2 * I, H),
                dequantize_rows(down.reshape(S * H, -1), d, I, dtype).view(S, H, I))

    auto_gemm = staticmethod(ExpertFormat.auto_gemm)  # the block kernel on CUDA, the dequantizing twin elsewhere

    def slot_gemm(self, kind: str, layer: int) -> GemmFn:
        """Layer `layer`'s decode GEMM over slots: "triton" (dequantizing inside the kernel) or
        "torch" (dequantize each routed slot, then the reference loop: the exact twin)."""
        if kind == "triton":
            from freetoken.kernels.triton.quant_moe_gemm import quant_slots_gemm

            gu, d = self.layer_types[layer]
            return partial(_triton_gemm, quant_slots_gemm, gu, d, self.hidden, self.inter)
        if kind == "torch":
            return partial(_torch_gemm, self, layer)
        raise ValueError(f"unknown slot GEMM {kind!r}: triton or torch")

    def prefill_gemm(self, layer: int):
        """The GEMM over a whole layer's experts (streamed or resident slots) for long prefill
        chunks: the layer's blocks dequantized on the device into x's dtype, then the grouped GEMM.
        The temporary is one layer of dequantized experts."""
        return partial(_prefill_gemm, self, layer)

    def cpu_banks(self, banks: tuple[torch.Tensor, ...]) -> tuple[np.ndarray, ...]:
        """The banks as the CPU kernel reads them: the same bytes as numpy arrays."""
        return tuple(bank.numpy() for bank in banks)

    def cpu_layout(self, config: ModelConfig):
        """What the CPU block kernel needs beyond the banks: each layer's types and the sizes."""
        from freetoken.kernels.cpu.quant_experts import QuantLayout

        types = np.array([[int(a), int(b)] for a, b in self.layer_types], dtype=np.int32).reshape(-1, 2)
        return QuantLayout(types, config.num_experts, self.hidden, self.inter)


def _aligned(nbytes: int) -> int:
    """Rows start 16 bytes apart, so the fill and the kernels load whole vectors."""
    return -(-nbytes // 16) * 16


def dequantize_rows(rows: torch.Tensor, qtype: GGMLType, n: int, dtype: torch.dtype) -> torch.Tensor:
    """rows uint8 [R, row_bytes] -> [R, n] in `dtype` (each value rounded once from its exact fp32
    dequantization), on the rows' device: the Triton kernel on CUDA, numpy on the host."""
    if rows.is_cuda:
        from freetoken.kernels.triton.quant_dequant import dequantize_rows as device_dequantize

        return device_dequantize(rows, int(qtype), n, dtype)
    return torch.from_numpy(dequantize(qtype, rows.contiguous().numpy(), n)).to(dtype)


def _triton_gemm(kernel, gu, d, hidden, inter, x, weights, routes, w13, w2, landing=None):
    return kernel(x, weights, routes, w13, w2, gu, d, hidden, inter)


def _torch_gemm(fmt: BlockQuantFormat, layer: int, x, weights, routes, w13, w2, landing=None):
    def one(slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, down = fmt.expert_weights(layer, w13, w2, slice(slot, slot + 1), x.dtype)
        return gate_up[0], down[0]

    return slot_gemm.expert_loop(x, weights, routes, w13.shape[0], one)


def _prefill_gemm(fmt: BlockQuantFormat, layer: int, x, weights, ids, w13, w2):
    return slot_gemm.grouped_slots_gemm(x, weights, ids, *fmt.expert_weights(layer, w13, w2, slice(None), x.dtype))


def block_format_for(source, config: ModelConfig) -> BlockQuantFormat | None:
    """The format of a GGUF file's experts, or None when they are unquantized (F32/F16/BF16: the
    unquantized formats read them). Refuses mixes the kernels do not compute."""
    sparse = [i for i in range(config.num_layers) if config.sparse_layers[i]]
    per_layer: dict[int, tuple[GGMLType, GGMLType]] = {}
    for layer in sparse:
        types = [GGMLType(source.expert_tensor(layer, proj)[0]) for proj in PROJECTIONS]
        if types[0] != types[1]:
            raise CheckpointError(f"layer {layer}: gate experts are {types[0].name} but up experts "
                                  f"{types[1].name}; the expert kernels need one type for both")
        per_layer[layer] = (types[0], types[2])
    kinds = {t in BLOCK_QUANT_TYPES for pair in per_layer.values() for t in pair}
    if kinds == {False}:
        return None
    if kinds == {True, False}:
        raise CheckpointError("the experts mix block-quantized and unquantized types "
                              f"({sorted({t.name for p in per_layer.values() for t in p})}); not supported")
    first = per_layer[sparse[0]]
    return BlockQuantFormat(tuple(per_layer.get(i, first) for i in range(config.num_layers)),
                            config.hidden_size, config.moe_intermediate_size)
