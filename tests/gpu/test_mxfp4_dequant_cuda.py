"""The MXFP4 dequantizer compiled for the GPU (kernels/triton/mxfp4_dequant.py) against
`dequantize_mxfp4`'s torch ops, bit for bit but NaN payloads: on every code byte under every scale
byte, on the GPU and against the CPU's reference; and on a prefill group of gpt-oss-120b's gate_up
handed over as the format hands it (`ProjectionRows.dequantize`, which must take the kernel)."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels.registry import BIT_EXACT, compare_outputs
from freetoken.kernels.triton import mxfp4_dequant
from freetoken.moe.mxfp4_format import Mxfp4ExpertFormat
from freetoken.quant.mxfp4 import dequantize_mxfp4

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _every_byte_under_every_scale(device: str):
    """blocks [256, 16, 16]: row s holds the bytes 0..255 once, under scale byte s in each group."""
    blocks = torch.arange(256, dtype=torch.uint8, device=device).reshape(16, 16).expand(256, 16, 16)
    scales = torch.arange(256, dtype=torch.uint8, device=device)[:, None].expand(256, 16)
    return blocks.contiguous(), scales.contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_byte_under_every_scale_is_the_reference(dtype) -> None:
    blocks, scales = _every_byte_under_every_scale("cuda")
    got = mxfp4_dequant.dequantize_mxfp4_triton(blocks, scales, dtype)
    assert compare_outputs(got, dequantize_mxfp4(blocks, scales, dtype), BIT_EXACT) is None
    assert compare_outputs(got, dequantize_mxfp4(blocks.cpu(), scales.cpu(), dtype), BIT_EXACT) is None
    subnormal = (got != 0) & (got.abs() < torch.finfo(dtype).tiny)
    assert subnormal.any() and got.isinf().any() and got.isnan().any()  # the edges are in the table


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_gpt_oss_120b_prefill_group_through_the_format(dtype, monkeypatch) -> None:
    """4 experts of gate_up ([5760, 90, 16] blocks each) as views of their slots' byte rows."""
    fmt = Mxfp4ExpertFormat(2880, 2880, torch.bfloat16)
    proj = fmt.gate_up
    g = torch.Generator(device="cuda").manual_seed(1)
    width = fmt.banks(None)[0].row_shape[0]  # the w13 bank's rows
    bank = torch.randint(0, 256, (6, width), generator=g, device="cuda", dtype=torch.uint8)
    kernel, calls = mxfp4_dequant.dequantize_mxfp4_triton, []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(mxfp4_dequant, "dequantize_mxfp4_triton", counted)
    got, bias = proj.dequantize(bank, slice(1, 5), fmt.bias_dtype, dtype)
    assert calls == [(4, 5760, 90, 16)]
    blocks, scales, want_bias = proj.unpack(bank[1:5], fmt.bias_dtype)
    assert got.shape == (4, 5760, 2880) and got.dtype == dtype
    assert compare_outputs(got, dequantize_mxfp4(blocks, scales, dtype), BIT_EXACT) is None
    # routed slots by index, as a prefill group asks: read in place, the whole bank handed over
    picked = torch.tensor([4, 1, 4, 0], device="cuda")
    got, bias = proj.dequantize(bank, picked, fmt.bias_dtype, dtype)
    assert calls[1:] == [(6, 5760, 90, 16)]
    blocks, scales, want_bias = proj.unpack(bank[picked], fmt.bias_dtype)
    assert compare_outputs(got, dequantize_mxfp4(blocks, scales, dtype), BIT_EXACT) is None
    torch.testing.assert_close(bias, want_bias.to(dtype), rtol=0, atol=0, equal_nan=True)  # random bytes: NaNs
