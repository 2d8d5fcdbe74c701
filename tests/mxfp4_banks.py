"""MXFP4 expert banks for the CPU kernel's tests (kernels/cpu/mxfp4_experts.py), read into the
pool's layout by the format itself, with the kernel's twin and the error bound its docstring
states, computed from the dequantized banks."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from freetoken.moe.biased_expert_format import biased_bank_expert
from freetoken.moe.mxfp4_format import Mxfp4ExpertFormat
from freetoken.quant.mxfp4 import quantize_mxfp4
from freetoken.reference.moe import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT, clamped_swiglu

U = 2.0**-24  # fp32's unit roundoff


class _Tensors:
    """A checkpoint reader over a dict of tensors (what `Mxfp4ExpertFormat.read_layer` calls)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def get_packed(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.tensors[name].reshape(shape)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.tensors[name].reshape(shape).to(dtype)


def make_mxfp4_banks(F: int, H: int, I: int, bias_dtype: torch.dtype, seed: int):
    """(w13, w2 uint8 [F, bytes] numpy sharing the torch banks' memory, the format, its layout):
    F experts (one layer) of random weights, quantized, and random biases in `bias_dtype`."""
    g = torch.Generator().manual_seed(seed)
    fmt = Mxfp4ExpertFormat(H, I, bias_dtype)
    p = "model.layers.0.mlp.experts."
    tensors = {}
    for name, rows, columns in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
        weights = torch.randn(F, rows, columns, generator=g) * 0.5
        tensors[p + name + "_blocks"], tensors[p + name + "_scales"] = quantize_mxfp4(weights)
        tensors[p + name + "_bias"] = (torch.randn(F, rows, generator=g) * 0.5).to(bias_dtype)
    banks = tuple(torch.zeros(F, b.row_shape[0], dtype=torch.uint8) for b in fmt.banks(None))
    fmt.read_layer(_Tensors(tensors), SimpleNamespace(num_experts=F), 0, out=banks)
    return banks[0].numpy(), banks[1].numpy(), fmt, fmt.cpu_layout(SimpleNamespace(num_experts=F))


def dequantized(w13: np.ndarray, w2: np.ndarray, fmt: Mxfp4ExpertFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 biased rows (w13 [F, 2I, H+1], w2 [F, H, I+1]), as the device's loop computes with."""
    return fmt.expert_weights(torch.from_numpy(w13), torch.from_numpy(w2), slice(None), torch.float32)


def twin(x, weights, ids, w13, w2, fmt) -> np.ndarray:
    """The exact dequantization, then the fp32 biased clamped-SwiGLU expert per routed pair."""
    W13, W2 = dequantized(w13, w2, fmt)
    xt = torch.from_numpy(x)
    out = torch.zeros_like(xt)
    for n, k in zip(*np.nonzero(ids >= 0), strict=True):
        out[n] += float(weights[n, k]) * biased_bank_expert(xt[n : n + 1], W13[ids[n, k]], W2[ids[n, k]])[0]
    return out.numpy()


def error_bound(x, weights, ids, w13, w2, fmt, rounding: float = 0.0) -> np.ndarray:
    """The kernel's bound on |kernel - twin| per output element [N, H] (kernels/cpu/mxfp4_experts.py):
    two fp32 evaluations of the experts in any order. `rounding`: for two evaluations that also
    round their intermediates (gate/up, the activation, the projection, the weighted term, the
    sum) to a dtype, its unit roundoff (2**-8 for bf16): values that differ by d before a
    rounding may differ by d + 2 * rounding * |value| after it."""
    H, I = fmt.hidden, fmt.inter
    r = rounding
    W13, W2 = (w.double() for w in dequantized(w13, w2, fmt))
    xt = torch.from_numpy(x).double()
    bound = torch.zeros_like(xt)
    gamma_h, gamma_i, gamma_k = 2 * (H + 1) * U, 2 * (I + 1) * U, 2 * ids.shape[1] * U
    for n, k in zip(*np.nonzero(ids >= 0), strict=True):
        w13f, w2f = W13[ids[n, k]], W2[ids[n, k]]
        G, U_, bg, bu = w13f[:I, :H], w13f[I:, :H], w13f[:I, H], w13f[I:, H]
        D, bd = w2f[:, :I], w2f[:, I]
        gate, up = G @ xt[n] + bg, U_ @ xt[n] + bu
        eg = gamma_h * (G.abs() @ xt[n].abs() + bg.abs()) + 2 * r * gate.abs()
        eu = gamma_h * (U_.abs() @ xt[n].abs() + bu.abs()) + 2 * r * up.abs()
        g = gate.clamp(max=CLAMPED_SWIGLU_LIMIT)
        glu = (g * torch.sigmoid(CLAMPED_SWIGLU_ALPHA * g)).abs()
        act = clamped_swiglu(gate, up).abs()
        ea = 1.1 * eg * (up.abs() + 1 + eu) + glu * eu + (8 * U + 2 * r) * act
        out = (D @ clamped_swiglu(gate, up) + bd).abs()
        y = D.abs() @ ea + gamma_i * (D.abs() @ act + bd.abs()) + 2 * r * out
        weight = abs(float(weights[n, k]))
        bound[n] += weight * (y + (gamma_k + 2 * r) * out) + 2 * ids.shape[1] * r * weight * out
    return bound.numpy()
