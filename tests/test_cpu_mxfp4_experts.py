"""The CPU kernel of gpt-oss's MXFP4 experts (kernels/cpu/mxfp4_experts.py) against its twin (the
exact dequantization, then the fp32 biased clamped-SwiGLU expert) within the bound its docstring
states, at sizes of odd block counts, both bias dtypes, tokens routed to few or many experts and
routes left to other executors; and its refusal of banks that do not fit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.kernels.cpu.cpu_kernel import kernel_for
from freetoken.kernels.cpu.mxfp4_experts import cpu_moe_mxfp4
from tests.mxfp4_banks import error_bound, make_mxfp4_banks, twin


def _case(N: int, K: int, F: int, H: int, seed: int):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((N, H)) * 2).astype(np.float32)  # large enough to reach the clamp
    weights = rng.random((N, K)).astype(np.float32)
    ids = np.stack([rng.choice(F, K, replace=False) for _ in range(N)]).astype(np.int32)
    ids[rng.random((N, K)) < 0.2] = -1  # routes another executor computes
    return x, weights, ids


@pytest.mark.parametrize(("N", "K", "F", "H", "I", "bias"), [
    (1, 1, 1, 32, 32, torch.bfloat16),
    (3, 2, 5, 96, 160, torch.bfloat16),  # 3 and 5 blocks a row
    (7, 4, 6, 160, 96, torch.float32),
    (20, 3, 4, 64, 288, torch.float32),  # more tokens than experts: each expert read once for several
])
def test_the_kernel_computes_its_twin_within_the_stated_bound(N, K, F, H, I, bias):
    w13, w2, fmt, layout = make_mxfp4_banks(F, H, I, bias, seed=N + H)
    x, weights, ids = _case(N, K, F, H, seed=I)
    out = np.full_like(x, np.nan)
    cpu_moe_mxfp4(x, weights, ids, w13, w2, layout, out)
    want = twin(x, weights, ids, w13, w2, fmt)
    bound = error_bound(x, weights, ids, w13, w2, fmt)
    assert np.all(np.abs(out - want) <= bound), float(np.max(np.abs(out - want) - bound))
    assert np.abs(want).max() > 10 * bound.max()  # the bound is tight enough to mean something
    # through the executor's Python entry point as well, bit for bit
    again = np.empty_like(x)
    kernel_for(w13, w2, layout).run(x, weights, ids, again)
    np.testing.assert_array_equal(again, out)


def test_nothing_routed_gives_zeros():
    w13, w2, _, layout = make_mxfp4_banks(2, 32, 32, torch.bfloat16, seed=0)
    x = np.ones((2, 32), np.float32)
    out = np.full_like(x, np.nan)
    cpu_moe_mxfp4(x, np.ones((2, 1), np.float32), np.full((2, 1), -1, np.int32), w13, w2, layout, out)
    assert not out.any()


def test_banks_narrower_than_the_layout_are_refused():
    w13, w2, _, layout = make_mxfp4_banks(2, 64, 32, torch.float32, seed=0)
    with pytest.raises(ValueError, match="do not fit the layout"):
        kernel_for(np.ascontiguousarray(w13[:, :100]), w2, layout)
    with pytest.raises(ValueError, match="unit stride"):  # every other column of a wider x
        cpu_moe_mxfp4(np.ones((1, 128), np.float32)[:, ::2], np.ones((1, 1), np.float32),
                      np.zeros((1, 1), np.int32), w13, w2, layout, np.empty((1, 64), np.float32))
    with pytest.raises(ValueError, match="expert id out of range"):
        cpu_moe_mxfp4(np.ones((1, 64), np.float32), np.ones((1, 1), np.float32), np.full((1, 1), 2, np.int32),
                      w13, w2, layout, np.empty((1, 64), np.float32))


@pytest.mark.parametrize("poller", ["team", "per-call"])
def test_the_pollers_answer_captured_rings_with_the_kernels_result(poller):
    """A captured decode step rings the poller for hybrid's and cpu's MXFP4 routes: each ring's
    answer equals a direct kernel call bit for bit (the work units split alike), whoever answers."""
    from tests.test_doorbell import answers_through_poller

    F, H, I, K = 5, 96, 160, 2
    w13, w2, fmt, layout = make_mxfp4_banks(F, H, I, torch.bfloat16, seed=3)
    layers = [(layer, *_case(n, K, F, H, seed=layer)) for layer, n in enumerate((1, 3, 2))]
    results = answers_through_poller(w13, w2, layout, poller, layers, rows=3, top_k=K, hidden=H)
    for (_, x, weights, ids), got in zip(layers, results, strict=True):
        want = np.full_like(x, np.nan)
        cpu_moe_mxfp4(x, weights, ids, w13, w2, layout, want)
        np.testing.assert_array_equal(got, want)
        assert np.all(np.abs(got - twin(x, weights, ids, w13, w2, fmt)) <= error_bound(x, weights, ids, w13, w2, fmt))
