"""The MXFP4 format's prefill GEMM (the routed slots dequantized a group at a time, two grouped
GEMMs per group: moe/grouped_biased_gemm.py) against the format's expert loop on the same bytes.

Both evaluate every (token, k) term with fp32 accumulation and round where the activation dtype
makes them round (gate/up, the activation, the projection, the weighted term), but their GEMMs
sum in orders of their own (a one-row product takes another BLAS routine than a grouped one), and
they sum a token's K terms differently: the loop one by one in the activation dtype, the grouped
GEMM in fp32, rounded once. So they agree within tests/mxfp4_banks.py's `error_bound` for two
such evaluations, with the dtype's unit roundoff for its roundings (2**-24 fp32, 2**-8 bf16)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from freetoken.moe import mxfp4_format
from freetoken.moe.grouped_biased_gemm import grouped_biased_gemm
from tests.mxfp4_banks import error_bound, make_mxfp4_banks

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


def _banks(F: int, H: int, I: int, bias_dtype: torch.dtype, seed: int):
    w13, w2, fmt, _ = make_mxfp4_banks(F, H, I, bias_dtype, seed)
    return torch.from_numpy(w13), torch.from_numpy(w2), fmt


def _routes(n: int, k: int, F: int, unused: list[int], p_elsewhere: float, g: torch.Generator) -> torch.Tensor:
    """[n, k] int32 over the slots not in `unused` (repeats within a row allowed), some -1."""
    kept = torch.tensor([s for s in range(F) if s not in unused] or [0])
    routes = kept[torch.randint(0, len(kept), (n, k), generator=g)].to(torch.int32)
    routes[torch.rand(n, k, generator=g) < p_elsewhere] = -1
    return routes


def _prefill(fmt, slots_per_group: int, x, *args) -> torch.Tensor:
    """`fmt.prefill_gemm` with a group budget of `slots_per_group` experts in x's dtype."""
    expert_bytes = 3 * fmt.hidden * fmt.inter * x.element_size()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mxfp4_format, "PREFILL_GROUP_BYTES", slots_per_group * expert_bytes)
        return fmt.prefill_gemm(0)(x, *args)


@settings(max_examples=60, deadline=None)
@example(n=1, k=1, F=1, H=32, I=32, dtype=torch.float32, bias_dtype=torch.float32, fp32_weights=False,
         p_elsewhere=0.0, unused=[], slots_per_group=1, seed=0)  # one row: the loop's GEMM sums in another order
@given(n=st.integers(1, 33), k=st.integers(1, 4), F=st.integers(1, 7), H=st.sampled_from([32, 96]),
       I=st.sampled_from([32, 64]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       bias_dtype=st.sampled_from([torch.float32, torch.bfloat16]), fp32_weights=st.booleans(),
       p_elsewhere=st.sampled_from([0.0, 0.3, 1.0]), unused=st.lists(st.integers(0, 6), max_size=4),
       slots_per_group=st.integers(1, 8), seed=st.integers(0, 2**31 - 1))
def test_the_grouped_prefill_matches_the_loop_within_the_final_sum(n, k, F, H, I, dtype, bias_dtype, fp32_weights,
                                                                   p_elsewhere, unused, slots_per_group, seed):
    w13, w2, fmt = _banks(F, H, I, bias_dtype, seed % 1000)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, H, generator=g) * 2).to(dtype)  # large enough to reach the clamp
    weights = torch.rand(n, k, generator=g).to(torch.float32 if fp32_weights else dtype)
    routes = _routes(n, k, F, unused, p_elsewhere, g)
    loop = fmt.slot_gemm("torch", 0)
    want = loop(x, weights, routes, w13, w2)
    got = _prefill(fmt, slots_per_group, x, weights, routes, w13, w2)
    assert got.dtype == dtype and got.shape == want.shape
    bound = torch.from_numpy(error_bound(x.float().numpy(), weights.float().numpy(), routes.numpy(), w13.numpy(),
                                         w2.numpy(), fmt, rounding=UNIT_ROUNDOFF[dtype]))
    assert ((got.float() - want.float()).abs() <= bound).all(), float((got.float() - want.float() - bound).max())
    assert not got[(routes < 0).all(dim=1)].any()  # a token with every route elsewhere gets nothing
    assert torch.equal(got, _prefill(fmt, slots_per_group, x, weights, routes, w13, w2))  # deterministic


def test_only_routed_slots_are_dequantized_a_bounded_group_at_a_time():
    F, H, I = 9, 32, 32
    w13, w2, fmt = _banks(F, H, I, torch.bfloat16, seed=4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(31, H, generator=g)
    weights = torch.rand(31, 2, generator=g)
    routes = _routes(31, 2, F, [0, 4, 8], 0.2, g)  # the first, an inner and the last slot unused
    asked = {"gate_up": [], "down": []}

    def projection(name, bank, rows):
        def weights_of(slots):
            asked[name].append(slots.tolist())
            return rows.dequantize(bank, slots, fmt.bias_dtype, x.dtype)
        return weights_of

    got = grouped_biased_gemm(x, weights, routes, F, 4, projection("gate_up", w13, fmt.gate_up),
                              projection("down", w2, fmt.down))
    routed = sorted(set(routes[routes >= 0].tolist()))
    assert routed == [1, 2, 3, 5, 6, 7]
    assert asked["gate_up"] == asked["down"] == [[1, 2, 3, 5], [6, 7]]
    want = fmt.slot_gemm("torch", 0)(x, weights, routes, w13, w2)
    assert torch.allclose(got, want, rtol=0, atol=4 * 2.0**-24 * float(want.abs().max()))


def test_nothing_routed_gives_zeros_and_no_dequantization():
    w13, w2, fmt = _banks(3, 32, 32, torch.float32, seed=6)
    x = torch.randn(5, 32)

    def refused(slots):
        raise AssertionError(f"slots {slots.tolist()} dequantized with nothing routed to them")

    routes = torch.full((5, 2), -1, dtype=torch.int32)
    got = grouped_biased_gemm(x, torch.rand(5, 2), routes, 3, 2, refused, refused)
    assert torch.equal(got, torch.zeros_like(x))
    assert torch.equal(fmt.prefill_gemm(0)(x, torch.rand(5, 2), routes, w13, w2), torch.zeros_like(x))


def test_a_group_needs_a_slot():
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="slots_per_group"):
        grouped_biased_gemm(x, torch.rand(2, 1), torch.zeros(2, 1, dtype=torch.int32), 1, 0, None, None)
