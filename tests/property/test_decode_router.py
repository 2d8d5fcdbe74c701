"""The router in one launch (kernels/triton/decode_router.py): what the two launches it joins
give (the same logits and experts bit for bit, the weights within route's bound), its counter
back at zero after every launch, and which rows take it."""

from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (the interpreter: tests/property/conftest.py)


def _inputs(rows: int, experts: int = 128, hidden: int = 256, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(experts, hidden, generator=g) / hidden**0.5).to(dtype).to(DEVICE)
    return x, w


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_launch_equals_the_two_it_joins(rows: int, dtype) -> None:
    from freetoken.kernels.specs.dense import _route_compare
    from freetoken.kernels.specs.router import ROUTING_GUARANTEE as ROUTING
    from freetoken.kernels.triton.decode_linear import decode_linear
    from freetoken.kernels.triton.decode_router import _counter, decode_router
    from freetoken.kernels.triton.routing import fused_route

    x, w = _inputs(rows, dtype=dtype, seed=rows)
    for renormalize, weights_fp32 in [(True, False), (False, True)]:
        logits, weights, ids = decode_router(x, w, 8, renormalize, weights_fp32)
        want_logits = decode_linear(x, w)
        want_weights, want_ids = fused_route(want_logits, 8, renormalize, weights_fp32)
        assert torch.equal(logits, want_logits) and torch.equal(ids, want_ids)
        # the weights' fp32 sums run over the launch's warps, whose number differs between the
        # two (4 or 8 against 1): their order, and so their last bits, may differ (route's bound)
        assert _route_compare((weights.cpu(), ids.cpu()), (want_weights.cpu(), want_ids.cpu()), ROUTING) is None
        assert int(_counter(x.device).item()) == 0  # put back for the next launch


def test_route_tokens_takes_the_fused_kernel_for_decode_rows_only() -> None:
    import torch.nn.functional as F

    from freetoken.kernels.triton.decode_linear import MAX_ROWS
    from freetoken.kernels.triton.decode_router import decode_router, route_tokens
    from freetoken.kernels.triton.routing import fused_route

    few, w = _inputs(MAX_ROWS)
    many, _ = _inputs(MAX_ROWS + 1)
    for got, want in zip(route_tokens(few, w, 4, True, False), decode_router(few, w, 4, True, False), strict=True):
        assert torch.equal(got, want)
    logits = F.linear(many, w)  # a prompt's rows: cuBLAS (torch), then the routing kernel
    for got, want in zip(route_tokens(many, w, 4, True, False), (logits, *fused_route(logits, 4, True, False)),
                         strict=True):
        assert torch.equal(got, want)
    strided = w.T.contiguous().T
    assert torch.equal(route_tokens(few, strided, 4, True, False)[0], F.linear(few, w))
    with pytest.raises(ValueError):
        decode_router(many, w, 4, True, False)
    with pytest.raises(ValueError):
        decode_router(few, w, 129, True, False)  # top-k beyond the experts
