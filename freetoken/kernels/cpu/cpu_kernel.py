"""Which CPU expert kernel a pool's banks take, for Python callers (`CpuKernel`) and for the
compiled pollers (`ring_experts`, `ring_gate_up`, `ring_down`).

Three bank formats, told apart by the banks' and the layout's types, so one compiled poller
source serves all (Numba compiles a poller per format):
  - bf16: w13 uint16 [F, 2I, H], w2 uint16 [F, H, I] (kernels/cpu/experts.py);
  - GGUF blocks: w13, w2 uint8 [F, bytes] with a type per layer (kernels/cpu/quant_experts.py);
  - gpt-oss's MXFP4 blocks: w13, w2 uint8 [F, bytes] (kernels/cpu/mxfp4_experts.py), told from
    GGUF blocks by the layout, whose first item is the bias code (an int) instead of the types array.
Every kernel takes a `layout` tuple whose last item is the intermediate size: GGUF's (layer_types
int32 [L, 2], experts per layer, intermediate), MXFP4's (bias code, experts per layer,
intermediate); the bf16 kernels read none of it (their banks carry their shapes); the pollers read
the intermediate size from it whatever the format.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import types
from numba.extending import overload

from freetoken.kernels.cpu.experts import (
    DOWN_ROWS,
    GATE_ROWS,
    PREFETCH,
    cpu_moe,
    down_range,
    experts_tuned,
    gate_up_range,
)
from freetoken.kernels.cpu.mxfp4_experts import (
    Mxfp4Layout,
    cpu_moe_mxfp4_tuned,
    mxfp4_down_range,
    mxfp4_experts,
    mxfp4_gate_up_range,
)
from freetoken.kernels.cpu.quant_experts import (
    QuantLayout,
    cpu_moe_quant_tuned,
    quant_down_range,
    quant_experts,
    quant_gate_up_range,
)


@dataclass(frozen=True)
class CpuKernel:
    """A pool's CPU kernel: its banks, the layout the kernels take, and the Python entry point."""

    name: str  # "bf16", "gguf" or "mxfp4"
    w13: np.ndarray
    w2: np.ndarray
    layout: tuple  # (layer_types int32 [L, 2], experts per layer int64, intermediate int64)
    hidden: int
    intermediate: int

    def run(self, x: np.ndarray, weights: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
        """out = the weighted experts of every routed id (the compiled call releases the GIL)."""
        if self.name == "bf16":
            cpu_moe(x, weights, ids, self.w13, self.w2, out)
        elif self.name == "mxfp4":
            cpu_moe_mxfp4_tuned(x, weights, ids, self.w13, self.w2, self.layout, out)
        else:
            cpu_moe_quant_tuned(x, weights, ids, self.w13, self.w2, self.layout, out)

    def poller_banks(self) -> tuple:
        """(w13, w2, layout): the pollers' bank arguments, in their order."""
        return self.w13, self.w2, self.layout


def bf16_kernel(w13: np.ndarray, w2: np.ndarray) -> CpuKernel:
    """The kernel of bf16 banks: w13 uint16 [F, 2I, H], w2 uint16 [F, H, I], C-contiguous."""
    for label, bank in (("w13_host", w13), ("w2_host", w2)):
        if bank.dtype != np.uint16 or bank.ndim != 3 or not bank.flags.c_contiguous:
            raise ValueError(f"{label} must be a C-contiguous uint16 [F, ., .] array of bf16 bits, "
                             f"got {bank.dtype} {bank.shape}")
    F, I2, H = w13.shape
    if w2.shape != (F, H, I2 // 2) or I2 % 2:
        raise ValueError(f"bank shapes disagree: w13 {w13.shape} needs w2 {(F, H, I2 // 2)}, got {w2.shape}")
    layout = (np.zeros((1, 2), np.int32), np.int64(F), np.int64(I2 // 2))
    return CpuKernel("bf16", w13, w2, layout, H, I2 // 2)


def gguf_kernel(w13: np.ndarray, w2: np.ndarray, layout: QuantLayout) -> CpuKernel:
    """The kernel of GGUF-block banks: w13, w2 uint8 [F, bytes] C-contiguous, F = L * E, each at
    least as wide as the widest layer's rows (`QuantLayout.bank_bytes`)."""
    for label, bank in (("w13_host", w13), ("w2_host", w2)):
        if bank.dtype != np.uint8 or bank.ndim != 2 or not bank.flags.c_contiguous:
            raise ValueError(f"{label} must be a C-contiguous uint8 [F, bytes] array of GGUF blocks, "
                             f"got {bank.dtype} {bank.shape}")
    F = len(layout.layer_types) * layout.experts_per_layer
    need13, need2 = layout.bank_bytes()
    if w13.shape[0] != F or w2.shape[0] != F or w13.shape[1] < need13 or w2.shape[1] < need2:
        raise ValueError(f"quantized banks w13 {w13.shape}, w2 {w2.shape} do not fit the layout: need "
                         f"{F} experts ({len(layout.layer_types)} layers x {layout.experts_per_layer}) "
                         f"and rows of at least {need13} and {need2} bytes")
    return CpuKernel("gguf", w13, w2, layout.kernel_args(), layout.hidden, layout.intermediate)


def mxfp4_kernel(w13: np.ndarray, w2: np.ndarray, layout: Mxfp4Layout) -> CpuKernel:
    """The kernel of MXFP4 banks: w13, w2 uint8 [F, bytes] C-contiguous, at least as wide as an
    expert's rows (`Mxfp4Layout.bank_bytes`)."""
    for label, bank in (("w13_host", w13), ("w2_host", w2)):
        if bank.dtype != np.uint8 or bank.ndim != 2 or not bank.flags.c_contiguous:
            raise ValueError(f"{label} must be a C-contiguous uint8 [F, bytes] array of MXFP4 blocks, "
                             f"got {bank.dtype} {bank.shape}")
    need13, need2 = layout.bank_bytes()
    if w13.shape[0] != w2.shape[0] or w13.shape[1] < need13 or w2.shape[1] < need2:
        raise ValueError(f"MXFP4 banks w13 {w13.shape}, w2 {w2.shape} do not fit the layout: need as many "
                         f"experts in each and rows of at least {need13} and {need2} bytes")
    return CpuKernel("mxfp4", w13, w2, layout.kernel_args(), layout.hidden, layout.intermediate)


def kernel_for(w13: np.ndarray, w2: np.ndarray, layout: QuantLayout | Mxfp4Layout | None) -> CpuKernel:
    """The kernel of these banks: by the layout's kind (GGUF blocks, MXFP4), bf16 without one."""
    if layout is None:
        return bf16_kernel(w13, w2)
    if isinstance(layout, Mxfp4Layout):
        return mxfp4_kernel(w13, w2, layout)
    return gguf_kernel(w13, w2, layout)


def _is_bf16(w13) -> bool:
    return isinstance(w13, types.Array) and w13.dtype == types.uint16 and w13.ndim == 3


def _is_mxfp4(layout) -> bool:
    """An MXFP4 layout (bias code, E, I) as Numba types it: its first item an integer."""
    return isinstance(layout, types.BaseTuple) and isinstance(layout.types[0], types.Integer)


def _mxfp4_layout(layout) -> bool:
    """The same test on a Python value."""
    return isinstance(layout[0], int | np.integer)


# The three below run any format's kernel (chosen by the banks' and layout's types), for compiled
# code; from Python they run the same functions directly.


def ring_experts(x, weights, ids, w13, w2, layout, out):
    """out = the experts of one ring: `experts_tuned` at its chosen loop shape, `quant_experts` or
    `mxfp4_experts`."""
    if w13.dtype == np.uint16:
        experts_tuned(x, weights, ids, w13, w2, out, np.int64(GATE_ROWS), np.int64(DOWN_ROWS), np.int64(PREFETCH))
    elif _mxfp4_layout(layout):
        mxfp4_experts(x, weights, ids, w13, w2, layout, out)
    else:
        quant_experts(x, weights, ids, w13, w2, layout, out)


def ring_gate_up(u, i0, i1, fids, starts, pair_n, x, w13, act, layout):
    """Phase 1 of distinct expert u over [i0, i1) of I (`gate_up_range` or a block format's twin)."""
    if w13.dtype == np.uint16:
        gate_up_range(u, i0, i1, fids, starts, pair_n, x, w13, act, GATE_ROWS, PREFETCH * GATE_ROWS * x.shape[1])
    elif _mxfp4_layout(layout):
        mxfp4_gate_up_range(u, i0, i1, fids, starts, pair_n, x, w13, act, layout)
    else:
        quant_gate_up_range(u, i0, i1, fids, starts, pair_n, x, w13, act, layout)


def ring_down(h0, h1, fids, starts, pair_n, pair_w, act, w2, out, layout):
    """Phase 2 over [h0, h1) of H (`down_range` or a block format's twin)."""
    if w2.dtype == np.uint16:
        down_range(h0, h1, fids, starts, pair_n, pair_w, act, w2, out, DOWN_ROWS, PREFETCH * DOWN_ROWS * act.shape[1])
    elif _mxfp4_layout(layout):
        mxfp4_down_range(h0, h1, fids, starts, pair_n, pair_w, act, w2, out, layout)
    else:
        quant_down_range(h0, h1, fids, starts, pair_n, pair_w, act, w2, out, layout)


@overload(ring_experts)
def _ring_experts(x, weights, ids, w13, w2, layout, out):
    if _is_bf16(w13):
        def bf16(x, weights, ids, w13, w2, layout, out):
            experts_tuned(x, weights, ids, w13, w2, out, np.int64(GATE_ROWS), np.int64(DOWN_ROWS), np.int64(PREFETCH))
        return bf16
    if _is_mxfp4(layout):
        def mxfp4(x, weights, ids, w13, w2, layout, out):
            mxfp4_experts(x, weights, ids, w13, w2, layout, out)
        return mxfp4

    def gguf(x, weights, ids, w13, w2, layout, out):
        quant_experts(x, weights, ids, w13, w2, layout, out)
    return gguf


@overload(ring_gate_up)
def _ring_gate_up(u, i0, i1, fids, starts, pair_n, x, w13, act, layout):
    if _is_bf16(w13):
        def bf16(u, i0, i1, fids, starts, pair_n, x, w13, act, layout):
            gate_up_range(u, i0, i1, fids, starts, pair_n, x, w13, act, GATE_ROWS, PREFETCH * GATE_ROWS * x.shape[1])
        return bf16
    if _is_mxfp4(layout):
        def mxfp4(u, i0, i1, fids, starts, pair_n, x, w13, act, layout):
            mxfp4_gate_up_range(u, i0, i1, fids, starts, pair_n, x, w13, act, layout)
        return mxfp4

    def gguf(u, i0, i1, fids, starts, pair_n, x, w13, act, layout):
        quant_gate_up_range(u, i0, i1, fids, starts, pair_n, x, w13, act, layout)
    return gguf


@overload(ring_down)
def _ring_down(h0, h1, fids, starts, pair_n, pair_w, act, w2, out, layout):
    if _is_bf16(w2):
        def bf16(h0, h1, fids, starts, pair_n, pair_w, act, w2, out, layout):
            down_range(h0, h1, fids, starts, pair_n, pair_w, act, w2, out, DOWN_ROWS,
                       PREFETCH * DOWN_ROWS * act.shape[1])
        return bf16
    if _is_mxfp4(layout):
        def mxfp4(h0, h1, fids, starts, pair_n, pair_w, act, w2, out, layout):
            mxfp4_down_range(h0, h1, fids, starts, pair_n, pair_w, act, w2, out, layout)
        return mxfp4

    def gguf(h0, h1, fids, starts, pair_n, pair_w, act, w2, out, layout):
        quant_down_range(h0, h1, fids, starts, pair_n, pair_w, act, w2, out, layout)
    return gguf
