"""quant/mxfp4.py's quantizer (synthetic checkpoints and GGUF exports; loading never quantizes)
against its rule written out by brute force: each block's exponent is the smallest that brings
its largest magnitude within 6, and each value takes the code nearest to it, a tie going to the
smaller magnitude; values on the midpoints between codes, at several block scales, included."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.quant.mxfp4 import BLOCK, FP4_VALUES, dequantize_mxfp4, quantize_mxfp4

MAGNITUDES = torch.tensor(FP4_VALUES[:8], dtype=torch.float64)


def _brute_force(x: torch.Tensor) -> torch.Tensor:
    """x [R, 32] fp32 -> its dequantized values [R, 32] by the rule, in fp64."""
    amax = x.abs().amax(dim=-1, keepdim=True).double()
    exponent = torch.zeros_like(amax)
    while bool((amax / torch.pow(2.0, exponent) > 6.0).any()):
        exponent = torch.where(amax / torch.pow(2.0, exponent) > 6.0, exponent + 1, exponent)
    while bool(((amax > 0) & (amax / torch.pow(2.0, exponent - 1) <= 6.0)).any()):
        exponent = torch.where((amax > 0) & (amax / torch.pow(2.0, exponent - 1) <= 6.0), exponent - 1, exponent)
    scaled = x.double() / torch.pow(2.0, exponent)
    distance = (scaled.abs().unsqueeze(-1) - MAGNITUDES).abs()
    nearest = MAGNITUDES[distance.argmin(dim=-1)]  # argmin: the first, i.e. the smaller, of a tie
    return torch.sign(scaled) * nearest * torch.pow(2.0, exponent)


_MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
values = st.one_of(st.floats(-8, 8, width=32), st.sampled_from(_MIDPOINTS + [-m for m in _MIDPOINTS]),
                   st.sampled_from(FP4_VALUES))


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(values, min_size=BLOCK, max_size=BLOCK), min_size=1, max_size=4),
       scale=st.sampled_from([2.0 ** -20, 0.125, 1.0, 1024.0]))
def test_each_value_takes_the_nearest_code_of_the_smallest_fitting_exponent(rows, scale):
    x = torch.tensor(rows, dtype=torch.float32) * scale
    blocks, scales = quantize_mxfp4(x)
    got = dequantize_mxfp4(blocks, scales).double()
    want = _brute_force(x)
    assert torch.equal(got.abs(), want.abs()), (x, got, want)
    assert bool(((got == 0) | (torch.sign(got) == torch.sign(x.double()))).all())
