"""gpt-oss's expert format: experts with biases and the clamped SwiGLU (reference/moe.py).

Each expert's biases travel with it, as one more column of its bank rows, so the host pool, the
slot fills and the slot cache hold and move them as they do any expert's rows:
    w13 [2I, H+1]  gate rows, then up rows (the checkpoint's even and odd columns); column H the bias
    w2  [H, I+1]   down rows; column I the bias
(in effect each projection is a linear map of [x, 1]).

Only the torch expert loop computes this format: the Triton slot GEMM and the CPU expert kernel
compute standard SwiGLU without biases, so the engine refuses them here rather than compute it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from freetoken.config import ModelConfig
from freetoken.errors import CheckpointError
from freetoken.loader.checkpoint import TensorReader, read_biased_expert_banks
from freetoken.moe.expert_format import Bank, ExpertFormat, format_for
from freetoken.moe.slot_gemm import GemmFn, torch_slots_gemm
from freetoken.reference.moe import clamped_swiglu_expert


def biased_bank_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert on its tokens from its biased rows: x [n, H], w13 [2I, H+1], w2 [H, I+1] -> [n, H]."""
    H, I = x.shape[-1], w2.shape[-1] - 1
    return clamped_swiglu_expert(x, w13[:, :H], w13[:, H], w2[:, :I], w2[:, I])


@dataclass(frozen=True)
class BiasedExpertFormat(ExpertFormat):
    def banks(self, config: ModelConfig) -> tuple[Bank, ...]:
        H, I = config.hidden_size, config.moe_intermediate_size
        return Bank("w13", (2 * I, H + 1), self.dtype), Bank("w2", (H, I + 1), self.dtype)

    def read_layer(self, reader: TensorReader, config: ModelConfig, layer: int, out: tuple[torch.Tensor, ...]) -> None:
        read_biased_expert_banks(reader, config, layer, self.dtype, out=out)

    @staticmethod
    def auto_gemm(device: str) -> str:
        """`--moe-gemm auto`: the torch loop on every device (no fused kernel computes these experts)."""
        return "torch"

    def slot_gemm(self, kind: str, layer: int) -> GemmFn:
        if kind != "torch":
            raise CheckpointError(
                f"--moe-gemm {kind}: the Triton slot GEMM computes standard SwiGLU without biases, not the "
                f"biased experts with the clamped SwiGLU of this checkpoint ({self.name}); use --moe-gemm torch")
        return partial(torch_slots_gemm, expert=biased_bank_expert)

    @staticmethod
    def prefill_gemm(layer: int) -> GemmFn:
        # (the grouped GEMMs compute SwiGLU without biases: long chunks take the expert loop)
        return partial(torch_slots_gemm, expert=biased_bank_expert)

    def cpu_refusal(self, policy: str, dtype: str) -> str:
        return (f"policy {policy!r} computes experts on the CPU with the Numba SwiGLU kernel, which knows neither "
                f"the expert biases nor the clamped SwiGLU of this checkpoint ({self.name}); use --moe-policy "
                "resident or transfer (or static with a slot for every expert)")


def format_for_model(reader: TensorReader, config: ModelConfig, compute_dtype: torch.dtype) -> ExpertFormat:
    """`format_for`'s choice of dtype, in the biased format where the config's experts have
    biases and the clamped SwiGLU (gpt_oss)."""
    base = format_for(reader, compute_dtype)
    if not config.expert_bias and config.expert_activation == "swiglu":
        return base
    if not (config.expert_bias and config.expert_activation == "clamped_swiglu"):
        raise CheckpointError(f"{config.arch}: experts with expert_bias={config.expert_bias} and "
                              f"{config.expert_activation!r}: no expert format computes that combination")
    return BiasedExpertFormat(f"{base.name}+bias", base.dtype, cpu_executable=False,
                              summary=f"{base.summary}, with biases and the clamped SwiGLU (gpt-oss)")
