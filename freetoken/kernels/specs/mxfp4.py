"""The MXFP4 pairs: the slot GEMM (kernels/triton/mxfp4_moe_gemm.py), gpt-oss's biased experts
with the clamped SwiGLU, against `dequantize_mxfp4` of the same banks and the fp32 expert loop; and
the device dequantizer (kernels/triton/mxfp4_dequant.py) against `dequantize_mxfp4`, bit for bit
(its cases are at the end of this module).

Inputs need no quantizer: any byte is two valid E2M1 codes, so the codes are random bytes; the
scale bytes are drawn from 118..126 (2**-9 .. 2**-1: with codes up to 6 and H, I <= 128 the
gate and up values reach past the clamp at 7 in some rows and stay well inside it in others) and
the biases are small normals in the bank's bias dtype (bf16 or fp32).

The twin is written here from quant/mxfp4.py and reference/moe.py (kernels may not import
freetoken.moe, whose `Mxfp4ExpertFormat.expert_weights` computes the same dequantization;
tests/property/test_mxfp4_kernels.py checks the kernel against that path as served).

Guarantee: `ByOutputDtype` as the quantized slot GEMM's (kernels/specs/quant.py): elementwise
|kernel - twin| <= r * |twin| + 2**-16 * max|twin|, r one rounding step of the output dtype
(bf16 2**-7, fp16 2**-10, fp32 2**-20). Each weight the kernel decodes equals the twin's bit for
bit (E2M1 times a power of two is exact in fp32), so only the fp32 sums' order differs (the
kernel scales each block's sum once and adds the blocks, the twin adds dequantized products),
plus the sigmoid's last bits (exp-based in the kernel, torch's in the twin); the first term lets
the two round to neighbouring output values, the second covers the order difference relative to
the output's scale, through the clamp and the SwiGLU (whose slope here is below ~10).
"""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.kernels.registry import BIT_EXACT, KernelSpec, register_kernel
from freetoken.kernels.specs.common import routed_inputs, torch_dtype
from freetoken.kernels.specs.quant import ByOutputDtype, _gemm_compare

SCALES = (118, 127)  # scale bytes drawn from [118, 127)


def random_projection(rng, slots: int, rows: int, columns: int, bias_dtype, pad: int):
    """uint8 [slots, bytes]: each slot's blocks [rows, G, 16], scales [rows, G], biases [rows] in
    `bias_dtype`, zeros to a multiple of 16 bytes, then `pad` more random bytes (a wider bank)."""
    import numpy as np
    import torch

    groups = columns // 32
    blocks = rng.integers(0, 256, (slots, rows * groups * 16), dtype=np.uint8)
    scales = rng.integers(*SCALES, (slots, rows * groups), dtype=np.uint8)
    bias = torch.from_numpy(rng.normal(0.0, 0.5, (slots, rows)).astype(np.float32)).to(bias_dtype)
    bias_bytes = bias.view(torch.uint8).numpy().reshape(slots, -1)
    used = blocks.shape[1] + scales.shape[1] + bias_bytes.shape[1]
    tail = np.zeros((slots, -(-used // 16) * 16 - used), np.uint8)
    padding = rng.integers(0, 256, (slots, pad), dtype=np.uint8)
    return torch.from_numpy(np.concatenate([blocks, scales, bias_bytes, tail, padding], axis=1))


def dequantized_projection(row, rows: int, columns: int, bias_dtype):
    """One slot's projection from its byte row: (fp32 [rows, columns], fp32 bias [rows])."""
    import torch

    from freetoken.quant.mxfp4 import dequantize_mxfp4

    groups = columns // 32
    scales_at = rows * groups * 16
    bias_at = scales_at + rows * groups
    blocks = row[:scales_at].reshape(rows, groups, 16)
    scales = row[scales_at:bias_at].reshape(rows, groups)
    bias = row[bias_at : bias_at + rows * bias_dtype.itemsize].clone().view(bias_dtype)
    return dequantize_mxfp4(blocks, scales, torch.float32).reshape(rows, columns), bias.float()


@dataclass(frozen=True)
class Mxfp4GemmCase:
    """Shapes, dtypes and a seed; `tensors()` draws x, weights, routes (-1 included) and banks."""

    n: int
    k: int
    slots: int
    hidden: int
    inter: int
    bias_dtype: str
    x_dtype: str
    w_dtype: str
    pad: int  # bytes after each bank row beyond the format's 16-byte alignment (a multiple of 4)
    blocks: tuple  # (act_blocks, down_blocks)
    seed: int

    def tensors(self) -> tuple:
        import numpy as np
        import torch

        rng = np.random.default_rng(self.seed)
        g = torch.Generator().manual_seed(self.seed)
        x, weights, routes = routed_inputs(g, self.n, self.k, self.slots, self.hidden, self.x_dtype, self.w_dtype)
        bias = torch_dtype(self.bias_dtype)
        w13 = random_projection(rng, self.slots, 2 * self.inter, self.hidden, bias, self.pad)  # [S, W13]
        w2 = random_projection(rng, self.slots, self.hidden, self.inter, bias, self.pad)  # [S, W2]
        return x, weights, routes, w13, w2, self.hidden, self.inter, bias


def _strategy():
    from hypothesis import strategies as st

    return st.builds(
        Mxfp4GemmCase, n=st.integers(1, 2), k=st.integers(1, 3), slots=st.integers(1, 3),
        hidden=st.sampled_from([64, 96, 128]), inter=st.sampled_from([64, 96, 128]),
        bias_dtype=st.sampled_from(["bfloat16", "float32"]),
        x_dtype=st.sampled_from(["bfloat16", "float16", "float32"]), w_dtype=st.sampled_from(["float32", "bfloat16"]),
        pad=st.sampled_from([0, 4, 16]),
        # one pass over the row's blocks, or several with a masked tail (96 = 3 blocks of 32)
        blocks=st.sampled_from([((8, 512), (8, 512)), ((8, 64), (8, 64))]),
        seed=st.integers(0, 2**31 - 1),
    )


def _kernel(case: Mxfp4GemmCase, device: str):
    from freetoken.kernels.triton.mxfp4_moe_gemm import mxfp4_slots_gemm

    tensors = case.tensors()
    on_device = [t.to(device) for t in tensors[:5]]
    act, down = case.blocks
    return mxfp4_slots_gemm(*on_device, *tensors[5:], act_blocks=act, down_blocks=down).cpu()


def mxfp4_slots_twin(x, weights, routes, w13, w2, hidden: int, inter: int, bias_dtype):
    """The fp32 expert loop over the dequantized slots, one rounding to x's dtype at the end."""
    import torch

    from freetoken.reference.moe import clamped_swiglu_expert

    out = torch.zeros(x.shape, dtype=torch.float32)  # [N, H]
    for n, row in enumerate(routes.tolist()):
        for k, slot in enumerate(row):
            if slot < 0:
                continue
            gate_up, b13 = dequantized_projection(w13[slot], 2 * inter, hidden, bias_dtype)  # interleaved rows
            down, b2 = dequantized_projection(w2[slot], hidden, inter, bias_dtype)
            y = clamped_swiglu_expert(x[n : n + 1].float(), torch.cat((gate_up[0::2], gate_up[1::2])),
                                      torch.cat((b13[0::2], b13[1::2])), down, b2)  # [1, H]
            out[n] += weights[n, k].float() * y[0]
    return out.to(x.dtype)


def _twin(case: Mxfp4GemmCase):
    return mxfp4_slots_twin(*case.tensors())


register_kernel(KernelSpec(
    name="mxfp4_slots_gemm", strategy=_strategy, kernel=_kernel, twin=_twin,
    guarantee=ByOutputDtype(rel=2.0**-7, abs=2.0**-16, fp16_rel=2.0**-10, fp32_rel=2.0**-20),
    compare=_gemm_compare, max_examples=6,
    doc="kernels/triton/mxfp4_moe_gemm.py vs dequantize_mxfp4 and the fp32 clamped-SwiGLU expert loop",
))


# The dequantizer's pair. Scale bytes are drawn over all 256 values (0's subnormal factor, 255's
# infinite one, products past fp32's and fp16's ranges) or over the range real weights take; the
# layouts are the ways callers hand blocks over.
DEQUANT_LAYOUTS = (
    "contiguous",  # blocks [slots, rows, G, 16] as allocated
    "bank",  # the format's views: each slot's projection sliced out of a wider byte row
    "unaligned",  # a contiguous view at an odd byte offset: the codes are copied to align their words
    "strided",  # every other group: the inner dimensions not one run, copied
    "matrix",  # blocks [slots * rows * G, 16], no leading dimension
)


@dataclass(frozen=True)
class Mxfp4DequantCase:
    slots: int
    rows: int
    groups: int
    layout: str
    pad: int  # bank layout: bytes past each row's 16-byte alignment (3: the words unaligned, a copy)
    all_scales: bool  # scale bytes over 0..255, else 118..127
    out_dtype: str
    block_groups: int  # groups per program
    seed: int
    picks: int = 0  # > 0: that many leading indices (repeats, any order) read in place by the kernel

    def picked(self, device: str = "cpu"):
        """int64 [picks] leading indices, or None (none asked for, or the matrix layout has no leading dimension)."""
        import numpy as np
        import torch

        if not self.picks or self.layout == "matrix":
            return None
        rng = np.random.default_rng(self.seed + 1)
        return torch.from_numpy(rng.integers(0, self.slots, self.picks, dtype=np.int64)).to(device)

    def tensors(self, device: str = "cpu"):
        """(blocks [..., G, 16], scales [..., G]) uint8 on `device`, laid out as `layout` says
        (the views are taken on the device, so they arrive there as a caller's would)."""
        import numpy as np
        import torch

        rng = np.random.default_rng(self.seed)
        S, R, G = self.slots, self.rows, self.groups
        wide = 2 * G if self.layout == "strided" else G
        codes = torch.from_numpy(rng.integers(0, 256, (S, R * wide * 16), dtype=np.uint8))
        exps = torch.from_numpy(rng.integers(*((0, 256) if self.all_scales else SCALES), (S, R * wide), np.uint8))
        if self.layout == "bank":
            width = -(-R * G * 17 // 16) * 16 + self.pad  # rows 16 bytes apart, as the format's, then pad
            tail = torch.from_numpy(rng.integers(0, 256, (S, width - R * G * 17), dtype=np.uint8))
            row = torch.cat((codes, exps, tail), dim=1).to(device)  # [S, W]
            at = R * G * 16
            return row[:, :at].reshape(S, R, G, 16), row[:, at : at + R * G].reshape(S, R, G)
        if self.layout == "unaligned":
            flat = torch.cat((torch.zeros(1, dtype=torch.uint8), codes.flatten())).to(device)
            return flat[1:].view(S, R, G, 16), exps.reshape(S, R, G).to(device)
        blocks, scales = codes.reshape(S, R, wide, 16).to(device), exps.reshape(S, R, wide).to(device)
        if self.layout == "strided":
            return blocks[:, :, ::2], scales[:, :, ::2]
        if self.layout == "matrix":
            return blocks.reshape(-1, 16), scales.reshape(-1)
        return blocks, scales


def _dequant_strategy():
    from hypothesis import strategies as st

    return st.builds(
        Mxfp4DequantCase, slots=st.integers(1, 3), rows=st.integers(1, 5), groups=st.integers(1, 9),
        layout=st.sampled_from(DEQUANT_LAYOUTS), pad=st.sampled_from([0, 3, 16]), all_scales=st.booleans(),
        out_dtype=st.sampled_from(["bfloat16", "float16", "float32"]), block_groups=st.sampled_from([2, 8, 128]),
        seed=st.integers(0, 2**31 - 1), picks=st.sampled_from([0, 1, 4]),
    )


def _dequant_kernel(case: Mxfp4DequantCase, device: str):
    import numpy as np

    from freetoken.kernels.triton.mxfp4_dequant import dequantize_mxfp4_triton

    with np.errstate(all="ignore"):  # the interpreter computes in numpy: 0 * inf is NaN, as in the twin
        return dequantize_mxfp4_triton(*case.tensors(device), torch_dtype(case.out_dtype),
                                       block_groups=case.block_groups, picked=case.picked(device)).cpu()


def _dequant_twin(case: Mxfp4DequantCase):
    from freetoken.quant.mxfp4 import dequantize_mxfp4

    blocks, scales = case.tensors()
    picked = case.picked()
    if picked is not None:
        blocks, scales = blocks[picked], scales[picked]
    return dequantize_mxfp4(blocks, scales, torch_dtype(case.out_dtype))


register_kernel(KernelSpec(
    name="mxfp4_dequant", strategy=_dequant_strategy, kernel=_dequant_kernel, twin=_dequant_twin,
    guarantee=BIT_EXACT, max_examples=15,
    doc="kernels/triton/mxfp4_dequant.py vs dequantize_mxfp4 (torch ops; picked rows gathered first), "
        "bit for bit but NaN payloads",
))
