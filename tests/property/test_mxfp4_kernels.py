"""The MXFP4 slot GEMM (kernels/triton/mxfp4_moe_gemm.py) on fixed cases: against its registered
twin for both bias dtypes, bf16 and fp32 inputs and a -1 route; against the format's own torch
path as served (moe/mxfp4_format.py, which lays the banks out); scale bytes 0 and 1; and the
errors bad arguments get. (The Hypothesis run of the pair is in test_kernels.py.)"""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels.registry import REGISTRY, check_case
from freetoken.kernels.specs import load_all_specs
from freetoken.kernels.specs.mxfp4 import Mxfp4GemmCase, mxfp4_slots_twin
from freetoken.kernels.specs.quant import ByOutputDtype
from freetoken.moe.mxfp4_format import Mxfp4ExpertFormat

load_all_specs()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(bias_dtype: str, x_dtype: str, seed: int, **changes) -> Mxfp4GemmCase:
    fields = dict(n=2, k=3, slots=3, hidden=96, inter=64, bias_dtype=bias_dtype, x_dtype=x_dtype, w_dtype="float32",
                  pad=4, blocks=((8, 64), (8, 64)), seed=seed)
    return Mxfp4GemmCase(**{**fields, **changes})


@pytest.mark.parametrize("bias_dtype, x_dtype", [("bfloat16", "bfloat16"), ("float32", "float32"),
                                                 ("bfloat16", "float32"), ("float32", "bfloat16")])
def test_mxfp4_slots_gemm_matches_twin(bias_dtype: str, x_dtype: str) -> None:
    case = _case(bias_dtype, x_dtype, seed=3)
    assert (case.tensors()[2] == -1).any()  # a route that adds nothing
    assert check_case("mxfp4_slots_gemm", case, DEVICE) is None


def test_mxfp4_slots_gemm_one_wide_pass() -> None:
    case = _case("bfloat16", "float32", seed=5, hidden=128, inter=96, blocks=((8, 512), (8, 512)), w_dtype="bfloat16")
    assert check_case("mxfp4_slots_gemm", case, DEVICE) is None


def test_the_format_serves_the_kernel_against_its_torch_path() -> None:
    """`slot_gemm("triton")` over banks of the format's layout, against `slot_gemm("torch")`
    (the routed slots dequantized by `expert_weights`, the loop) in fp32."""
    case = _case("bfloat16", "float32", seed=9, pad=0)
    x, weights, routes, w13, w2, hidden, inter, bias = case.tensors()
    fmt = Mxfp4ExpertFormat(hidden, inter, bias)
    assert w13.shape[1] == fmt.banks(None)[0].row_shape[0] and w2.shape[1] == fmt.banks(None)[1].row_shape[0]
    args = [t.to(DEVICE) for t in (x, weights, routes, w13, w2)]
    got = fmt.slot_gemm("triton", 0)(*args).cpu()
    want = fmt.slot_gemm("torch", 0)(*args).cpu()
    tol = REGISTRY["mxfp4_slots_gemm"].guarantee
    assert torch.allclose(got, want, rtol=tol.fp32_rel, atol=tol.abs * want.abs().max().item())


def test_scale_bytes_zero_and_one_are_exact_powers_of_two() -> None:
    """E8M0's smallest exponents: 2**-127 (fp32's subnormal) and 2**-126, as `dequantize_mxfp4`."""
    from freetoken.kernels.triton.mxfp4_moe_gemm import mxfp4_slots_gemm, projection_bytes

    case = _case("float32", "float32", seed=11, n=1, k=1, slots=1)
    x, weights, routes, w13, w2, hidden, inter, bias = case.tensors()
    routes.zero_()
    scales_at, bias_at, _ = projection_bytes(2 * inter, hidden, bias)
    w13[0, scales_at:bias_at:2] = 0  # every other block of gate_up at 2**-127, the others at 2**-126
    w13[0, scales_at + 1 : bias_at : 2] = 1
    w13[0, bias_at : bias_at + 2 * inter * 4] = 0  # no biases: gate and up are the tiny dots alone
    x = x * 2.0**120  # brings them into fp32's normal range
    got = mxfp4_slots_gemm(x.to(DEVICE), weights.to(DEVICE), routes.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE),
                           hidden, inter, bias).cpu()
    want = mxfp4_slots_twin(x, weights, routes, w13, w2, hidden, inter, bias)
    assert want.abs().max() > 0
    assert torch.allclose(got, want, rtol=2.0**-20, atol=2.0**-16 * want.abs().max().item())


def test_mxfp4_slots_gemm_rejects_bad_arguments() -> None:
    from freetoken.kernels.triton.mxfp4_moe_gemm import mxfp4_slots_gemm, projection_bytes

    x, weights, routes, w13, w2, hidden, inter, bias = _case("bfloat16", "float32", seed=1).tensors()
    end13 = projection_bytes(2 * inter, hidden, bias)[2]
    with pytest.raises(ValueError, match="w13 must be"):
        mxfp4_slots_gemm(x, weights, routes, w13[:, : end13 - 4], w2, hidden, inter, bias)  # too narrow
    with pytest.raises(ValueError, match="w2 must be"):
        mxfp4_slots_gemm(x, weights, routes, w13, w2.view(torch.int32), hidden, inter, bias)  # not bytes
    with pytest.raises(ValueError, match="routes int32"):
        mxfp4_slots_gemm(x, weights, routes.long(), w13, w2, hidden, inter, bias)
    with pytest.raises(ValueError, match="x must be"):
        mxfp4_slots_gemm(x, weights, routes, w13, w2, hidden + 32, inter, bias)
    with pytest.raises(ValueError, match="multiples of 32"):
        mxfp4_slots_gemm(x, weights, routes, w13, w2, hidden, inter + 1, bias)
    with pytest.raises(ValueError, match="bias_dtype"):
        mxfp4_slots_gemm(x, weights, routes, w13, w2, hidden, inter, torch.float16)
    with pytest.raises(ValueError, match="4-byte words"):
        mxfp4_slots_gemm(x, weights, routes, w13[:, 2:], w2, hidden, inter, bias)
    assert isinstance(REGISTRY["mxfp4_slots_gemm"].guarantee, ByOutputDtype)
