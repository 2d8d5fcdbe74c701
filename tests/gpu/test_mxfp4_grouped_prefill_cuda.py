"""The MXFP4 format's prefill GEMM on CUDA (bf16 grouped GEMMs, moe/grouped_biased_gemm.py)
against the expert loop on the same bytes, both judged against the loop in fp32 (where MXFP4's
values are exact and only accumulation order differs).

CUDA's GEMMs accumulate in an order of their own choosing, so the two bf16 paths round the
intermediate products differently and no per-element bound in terms of the K terms holds as on
the CPU (tests/test_mxfp4_grouped_prefill.py). What must hold: the grouped path is as close to
fp32 as the loop is (its worst element no further than twice the loop's worst, and its mean error
no larger than 1.5x the loop's), it routes every pair where the loop does (a misplaced pair
moves an element by the size of a term, orders of magnitude above either error), and a token
routed nowhere gets zeros."""

from __future__ import annotations

import pytest
import torch

from tests.mxfp4_banks import make_mxfp4_banks


@pytest.mark.parametrize("n, k, F, group", [(1, 4, 8, 8), (300, 4, 32, 5), (2048, 4, 128, 64), (777, 2, 16, 1)])
def test_grouped_prefill_is_as_close_to_fp32_as_the_loop(n, k, F, group, monkeypatch):
    H = I = 256
    w13, w2, fmt = make_mxfp4_banks(F, H, I, torch.bfloat16, seed=n)[:3]
    w13, w2 = torch.from_numpy(w13).cuda(), torch.from_numpy(w2).cuda()
    g = torch.Generator().manual_seed(k * 1000 + F)
    x32 = torch.randn(n, H, generator=g) * 2
    weights = torch.softmax(torch.randn(n, k, generator=g), dim=1)
    routes = torch.randint(0, F, (n, k), generator=g, dtype=torch.int32)
    routes[torch.rand(n, k, generator=g) < 0.25] = -1
    routes[0] = -1  # one token routed nowhere
    x32, weights, routes = x32.cuda(), weights.cuda(), routes.cuda()
    from freetoken.moe import mxfp4_format

    monkeypatch.setattr(mxfp4_format, "PREFILL_GROUP_BYTES", group * 3 * H * I * 2)
    loop = fmt.slot_gemm("torch", 0)
    truth = loop(x32, weights, routes, w13, w2)  # fp32 on CUDA: the loop (no grouped GEMM in fp32)
    x = x32.bfloat16()
    want = loop(x, weights.bfloat16(), routes, w13, w2).float()
    got = fmt.prefill_gemm(0)(x, weights.bfloat16(), routes, w13, w2)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    loop_error, grouped_error = (want - truth).abs(), (got.float() - truth).abs()
    scale = truth.abs().max().item()
    assert grouped_error.max().item() <= 2 * loop_error.max().item() + 2.0**-8 * scale * 1e-3
    assert grouped_error.mean().item() <= 1.5 * loop_error.mean().item() + 1e-6 * scale
    assert not got[0].any()
    assert torch.equal(got, fmt.prefill_gemm(0)(x, weights.bfloat16(), routes, w13, w2))  # deterministic
