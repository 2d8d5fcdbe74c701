"""The MXFP4 dequantizer (kernels/triton/mxfp4_dequant.py) against `dequantize_mxfp4`, bit for bit
but NaN payloads: every code byte under every scale byte in each output dtype; Hypothesis over
shapes, layouts (the format's bank views, unaligned and strided ones) and dtypes through the
registered pair; each layout once by name; and the errors bad arguments get. On CPU the kernel
runs in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.kernels.registry import BIT_EXACT, check_case, check_kernel, compare_outputs
from freetoken.kernels.specs import load_all_specs
from freetoken.kernels.specs.mxfp4 import DEQUANT_LAYOUTS, Mxfp4DequantCase
from freetoken.quant.mxfp4 import dequantize_mxfp4

load_all_specs()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _every_byte_under_every_scale():
    """blocks [4096, 16]: 16 blocks under each scale byte s (rows 16s .. 16s+15) hold bytes 0..255."""
    blocks = torch.arange(256, dtype=torch.uint8).repeat(256).reshape(4096, 16)
    scales = torch.arange(256, dtype=torch.uint8).repeat_interleave(16)
    return blocks, scales


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_byte_under_every_scale_is_the_reference(dtype) -> None:
    from freetoken.kernels.triton.mxfp4_dequant import dequantize_mxfp4_triton

    blocks, scales = _every_byte_under_every_scale()
    want = dequantize_mxfp4(blocks, scales, dtype)
    with np.errstate(all="ignore"):  # the interpreter's numpy: 0 * inf under scale byte 255
        got = dequantize_mxfp4_triton(blocks.to(DEVICE), scales.to(DEVICE), dtype, block_groups=512).cpu()
    assert compare_outputs(got, want, BIT_EXACT) is None
    # the table holds the edges the construction must get right: subnormals, infinities, NaN, -0
    finite = want[want.isfinite()]
    assert ((finite != 0) & (finite.abs() < torch.finfo(dtype).tiny)).any()
    assert want.isinf().any() and want.isnan().any() and (finite == 0).any()
    assert torch.signbit(finite[finite == 0]).any() and not torch.signbit(finite[finite == 0]).all()


def test_the_pair_holds_under_hypothesis() -> None:
    report = check_kernel("mxfp4_dequant", DEVICE, max_examples=30)
    assert report.passed, report.summary()


@pytest.mark.parametrize("picks", [0, 5])
@pytest.mark.parametrize("layout", DEQUANT_LAYOUTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_each_layout(layout: str, dtype: str, picks: int) -> None:
    case = Mxfp4DequantCase(slots=3, rows=2, groups=5, layout=layout, pad=3 if dtype == "float16" else 0,
                            all_scales=True, out_dtype=dtype, block_groups=4, seed=len(layout), picks=picks)
    assert check_case("mxfp4_dequant", case, DEVICE) is None


def test_picked_rows_are_read_in_place_in_any_order() -> None:
    """A prefill group's slots by index: repeats and any order, each output row its index's."""
    from freetoken.kernels.triton.mxfp4_dequant import dequantize_mxfp4_triton

    case = Mxfp4DequantCase(4, 3, 6, "bank", 0, True, "float32", 2, seed=9)
    blocks, scales = case.tensors(DEVICE)
    picked = torch.tensor([3, 0, 3, 2], device=DEVICE)
    with np.errstate(all="ignore"):
        got = dequantize_mxfp4_triton(blocks, scales, torch.float32, block_groups=2, picked=picked).cpu()
        for i, slot in enumerate(picked.tolist()):
            want = dequantize_mxfp4(blocks[slot].cpu(), scales[slot].cpu(), torch.float32)
            assert compare_outputs(got[i], want, BIT_EXACT) is None
    assert dequantize_mxfp4_triton(blocks, scales, torch.float32, picked=picked[:0]).shape == (0, 3, 6 * 32)


def test_the_formats_views_are_read_in_place() -> None:
    """A bank's slot rows (moe/mxfp4_format.py's `unpack`) reach the kernel without a copy."""
    from freetoken.kernels.triton.mxfp4_dequant import _outer_rows

    blocks, scales = Mxfp4DequantCase(3, 4, 6, "bank", 0, False, "bfloat16", 8, 0).tensors()
    assert not blocks.is_contiguous() and blocks.stride(0) % 16 == 0
    for t in (blocks, scales):
        rows = _outer_rows(t, 3)
        assert rows.data_ptr() == t.data_ptr() and rows.stride() == (t.stride(0), 1)
    strided = Mxfp4DequantCase(2, 2, 3, "strided", 0, False, "bfloat16", 8, 0).tensors()[0]
    assert _outer_rows(strided, 2).is_contiguous()


def test_bad_arguments_are_refused() -> None:
    from freetoken.kernels.triton.mxfp4_dequant import dequantize_mxfp4_triton

    blocks, scales = torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4_triton(blocks.view(torch.int8), scales)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4_triton(blocks, scales[:, :2])
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4_triton(blocks[..., :8], scales)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        dequantize_mxfp4_triton(blocks, scales, torch.float64)
    with pytest.raises(ValueError, match="picked indexes"):
        dequantize_mxfp4_triton(blocks, scales, picked=torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="picked indexes"):  # no leading dimension to index
        dequantize_mxfp4_triton(blocks[0], scales[0], picked=torch.tensor([0]))
    empty = dequantize_mxfp4_triton(blocks[:0], scales[:0], torch.bfloat16)
    assert empty.shape == (0, 96) and empty.dtype == torch.bfloat16
