"""The quantized-expert kernels on fixed cases: the dequantizer bit for bit against gguf for every
type (random scale bytes included), the slot GEMM for the Q4_K_M pairing and one with Q5_K / Q8_0,
and the errors bad arguments get. (The Hypothesis runs of both pairs are in test_kernels.py.)"""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels.registry import check_case
from freetoken.kernels.specs import load_all_specs
from freetoken.kernels.specs.quant import QTYPES, DequantCase, QuantGemmCase

load_all_specs()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("raw_scales", [False, True])
def test_dequantize_rows_equals_gguf(qtype: int, raw_scales: bool) -> None:
    case = DequantCase(qtype=qtype, rows=3, blocks=2, pad=6, out_dtype="bfloat16", raw_scales=raw_scales,
                       block=256, seed=qtype)
    assert check_case("dequantize_rows", case, DEVICE) is None


@pytest.mark.parametrize("gu_type, d_type, x_dtype", [(12, 14, "bfloat16"), (13, 8, "float32")])
def test_quant_slots_gemm_matches_twin(gu_type: int, d_type: int, x_dtype: str) -> None:
    case = QuantGemmCase(n=2, k=2, slots=3, hidden=256, inter=256, gu_type=gu_type, d_type=d_type,
                         x_dtype=x_dtype, w_dtype="float32", pad=16, blocks=((32, 128), (64, 64)), seed=7)
    assert check_case("quant_slots_gemm", case, DEVICE) is None


def test_quant_kernels_reject_bad_arguments() -> None:
    from freetoken.kernels.triton.quant_dequant import dequantize_rows, row_bytes
    from freetoken.kernels.triton.quant_moe_gemm import quant_slots_gemm

    with pytest.raises(ValueError, match="not one of"):
        row_bytes(2, 256)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        row_bytes(12, 300)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_rows(torch.zeros(2, 100, dtype=torch.uint8), 12, 256)
    x = torch.zeros(1, 256)
    routes = torch.zeros(1, 2, dtype=torch.int32)
    w13 = torch.zeros(1, 2 * 256 * 144, dtype=torch.uint8)
    w2 = torch.zeros(1, 256 * 210, dtype=torch.uint8)
    with pytest.raises(ValueError, match="w2 must be"):
        quant_slots_gemm(x, torch.zeros(1, 2), routes, w13, w2[:, :-1], 12, 14, 256, 256)
    with pytest.raises(ValueError, match="x must be"):
        quant_slots_gemm(x, torch.zeros(1, 2), routes, w13, w2, 12, 14, 512, 256)
    with pytest.raises(ValueError, match="routes int32"):
        quant_slots_gemm(x, torch.zeros(1, 2), routes.long(), w13, w2, 12, 14, 256, 256)
    with pytest.raises(ValueError, match="4-byte words"):  # Q4_K banks are read as int32 words
        quant_slots_gemm(x, torch.zeros(1, 2), routes, torch.zeros(1, 2 * 256 * 144 + 2, dtype=torch.uint8), w2,
                         12, 14, 256, 256)
