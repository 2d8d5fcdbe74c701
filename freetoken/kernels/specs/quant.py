"""Pairs of the quantized-expert kernels: the device dequantizer against `gguf.quants.dequantize`
(bit-exact) and the quantized slot GEMM against the fp32 expert loop over gguf's dequantization.

Inputs need no quantizer: random bytes are valid Q8_0 and K-quant blocks once their f16 scale
fields hold finite values, which `random_rows` writes at a size that keeps the dequantized
weights near 1/sqrt(n) (so that SwiGLU's outputs stay in the range where errors show).
"""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.kernels.registry import BIT_EXACT, KernelSpec, Tolerance, register_kernel
from freetoken.kernels.specs.common import routed_inputs, torch_dtype

QTYPES = (8, 12, 13, 14)  # Q8_0, Q4_K, Q5_K, Q6_K
# GGUF type id -> (byte offsets of its f16 scale fields in a block, typical |scale * q|)
_SCALE_FIELDS = {8: ((0,), 64.0), 12: ((0, 2), 240.0), 13: ((0, 2), 500.0), 14: ((208,), 1000.0)}


def random_rows(rng, qtype: int, rows: int, n: int, raw_scales: bool = False):
    """uint8 [rows, row_bytes] of random `qtype` blocks; raw_scales keeps the random f16 scale
    bytes (subnormals, infinities and NaNs included) instead of modest finite ones."""
    import numpy as np

    from freetoken.kernels.triton.quant_dequant import BLOCKS, row_bytes

    elements, nbytes = BLOCKS[qtype]
    data = rng.integers(0, 256, (rows, row_bytes(qtype, n)), dtype=np.uint8)
    if raw_scales:
        return data
    blocks = data.reshape(rows, n // elements, nbytes)
    offsets, typical = _SCALE_FIELDS[qtype]
    for offset in offsets:
        size = rng.uniform(0.5, 1.5, blocks.shape[:2]) * rng.choice([-1.0, 1.0], blocks.shape[:2])
        field = (size / (typical * n**0.5)).astype(np.float16)
        blocks[:, :, offset : offset + 2] = field.view(np.uint8).reshape(rows, -1, 2)
    return data


@dataclass(frozen=True)
class DequantCase:
    qtype: int
    rows: int
    blocks: int  # per row
    pad: int  # bytes after each row (a bank's padding)
    out_dtype: str
    raw_scales: bool
    block: int  # elements per program
    seed: int

    def source(self):
        """uint8 [rows, row_bytes + pad] (the padding random too: it must be ignored), and n."""
        import numpy as np
        import torch

        from freetoken.kernels.triton.quant_dequant import BLOCKS

        rng = np.random.default_rng(self.seed)
        n = self.blocks * BLOCKS[self.qtype][0]
        data = random_rows(rng, self.qtype, self.rows, n, self.raw_scales)
        padding = rng.integers(0, 256, (self.rows, self.pad), dtype=np.uint8)
        return torch.from_numpy(np.concatenate([data, padding], axis=1)), n


def _dequant_strategy():
    from hypothesis import strategies as st

    return st.builds(
        DequantCase, qtype=st.sampled_from(QTYPES), rows=st.integers(1, 5), blocks=st.integers(1, 3),
        pad=st.sampled_from([0, 6]), out_dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
        raw_scales=st.booleans(), block=st.sampled_from([32, 256, 1024]), seed=st.integers(0, 2**31 - 1),
    )


def _dequant_kernel(case: DequantCase, device: str):
    import numpy as np

    from freetoken.kernels.triton.quant_dequant import dequantize_rows

    src, n = case.source()
    with np.errstate(all="ignore"):  # random scale bytes hold infinities (the interpreter computes in numpy)
        return dequantize_rows(src.to(device), case.qtype, n, torch_dtype(case.out_dtype), block=case.block).cpu()


def _dequant_twin(case: DequantCase):
    import gguf
    import numpy as np
    import torch
    from gguf.quants import dequantize

    src, n = case.source()
    data = src.numpy()[:, : src.shape[1] - case.pad]
    with np.errstate(all="ignore"):  # as in the kernel: inf * 0 is NaN on both sides
        values = dequantize(data, gguf.GGMLQuantizationType(case.qtype))
    return torch.from_numpy(values).to(torch_dtype(case.out_dtype))


register_kernel(KernelSpec(
    name="dequantize_rows", strategy=_dequant_strategy, kernel=_dequant_kernel, twin=_dequant_twin,
    guarantee=BIT_EXACT, max_examples=12,
    doc="kernels/triton/quant_dequant.py vs gguf.quants.dequantize, then torch's cast",
))


@dataclass(frozen=True)
class QuantGemmCase:
    """Shapes, types and a seed; `tensors()` draws x, weights, routes (-1 included) and banks."""

    n: int
    k: int
    slots: int
    hidden: int
    inter: int
    gu_type: int
    d_type: int
    x_dtype: str
    w_dtype: str
    pad: int  # bytes of padding after each bank row
    blocks: tuple  # (act_blocks, down_blocks)
    seed: int

    def tensors(self) -> tuple:
        import numpy as np
        import torch

        rng = np.random.default_rng(self.seed)
        g = torch.Generator().manual_seed(self.seed)
        x, weights, routes = routed_inputs(g, self.n, self.k, self.slots, self.hidden, self.x_dtype, self.w_dtype)

        def bank(qtype, rows, n):
            data = random_rows(rng, qtype, self.slots * rows, n).reshape(self.slots, -1)
            pad = np.zeros((self.slots, self.pad), np.uint8)
            return torch.from_numpy(np.concatenate([data, pad], axis=1))

        w13 = bank(self.gu_type, 2 * self.inter, self.hidden)  # [S, 2I rows of H]
        w2 = bank(self.d_type, self.hidden, self.inter)  # [S, H rows of I]
        return x, weights, routes, w13, w2, self.gu_type, self.d_type, self.hidden, self.inter


def _gemm_strategy():
    from hypothesis import strategies as st

    return st.builds(
        QuantGemmCase, n=st.integers(1, 2), k=st.integers(1, 2), slots=st.integers(1, 3),
        hidden=st.sampled_from([256, 512]), inter=st.sampled_from([256, 512]),
        gu_type=st.sampled_from(QTYPES), d_type=st.sampled_from(QTYPES),
        x_dtype=st.sampled_from(["bfloat16", "float16", "float32"]), w_dtype=st.sampled_from(["float32", "bfloat16"]),
        pad=st.sampled_from([0, 16]),
        # wide tiles keep the interpreter fast; tiles narrower than a K-quant block split it
        blocks=st.sampled_from([((64, 512), (64, 512)), ((32, 128), (64, 64))]),
        seed=st.integers(0, 2**31 - 1),
    )


@dataclass(frozen=True)
class ByOutputDtype(Tolerance):
    """`rel` for bf16 outputs, `fp16_rel` and `fp32_rel` for the others; one `abs` for all."""

    fp16_rel: float = 0.0
    fp32_rel: float = 0.0

    def __str__(self) -> str:
        return (f"|d| <= r*|twin| + {self.abs:.3g}*max|twin|, r = {self.rel:.3g} (bf16), "
                f"{self.fp16_rel:.3g} (fp16), {self.fp32_rel:.3g} (fp32)")


def _gemm_compare(got, want, guarantee: ByOutputDtype) -> str | None:
    import torch

    from freetoken.kernels.registry import compare_outputs

    rel = {torch.bfloat16: guarantee.rel, torch.float16: guarantee.fp16_rel}.get(want.dtype, guarantee.fp32_rel)
    return compare_outputs(got, want, Tolerance(rel, guarantee.abs))


def _gemm_kernel(case: QuantGemmCase, device: str):
    from freetoken.kernels.triton.quant_moe_gemm import quant_slots_gemm

    tensors = case.tensors()
    on_device = [t.to(device) for t in tensors[:5]]
    act, down = case.blocks
    return quant_slots_gemm(*on_device, *tensors[5:], act_blocks=act, down_blocks=down).cpu()


def _gemm_twin(case: QuantGemmCase):
    from freetoken.reference.quant_moe_slots import quant_moe_slots

    return quant_moe_slots(*case.tensors())


register_kernel(KernelSpec(
    name="quant_slots_gemm", strategy=_gemm_strategy, kernel=_gemm_kernel, twin=_gemm_twin,
    guarantee=ByOutputDtype(rel=2.0**-7, abs=2.0**-16, fp16_rel=2.0**-10, fp32_rel=2.0**-20),
    compare=_gemm_compare, max_examples=4,
    doc="kernels/triton/quant_moe_gemm.py vs reference/quant_moe_slots.py (gguf dequantization, fp32 loop)",
))
