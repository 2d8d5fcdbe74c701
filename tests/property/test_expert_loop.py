"""The engine's expert loops: the torch loop (one host sync per call) equals the reference loop
bit for bit; the grouped GEMMs of long prefill chunks agree with it up to the final sum."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.moe.slot_gemm import grouped_slots_gemm, torch_slots_gemm
from freetoken.reference.moe import moe_experts


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 24), k=st.integers(1, 4), slots=st.integers(1, 9),
       dtype=st.sampled_from(["float32", "bfloat16"]), p_cpu=st.sampled_from([0.0, 0.3, 1.0]),
       seed=st.integers(0, 2**31 - 1))
def test_grouped_loop_equals_the_reference(n, k, slots, dtype, p_cpu, seed):
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    h, inter = 16, 8
    x = torch.randn(n, h, generator=g).to(dt)
    weights = torch.rand(n, k, generator=g).to(dt)
    routes = torch.randint(0, slots, (n, k), generator=g, dtype=torch.int32)  # repeats within a row allowed
    routes[torch.rand(n, k, generator=g) < p_cpu] = -1
    w13 = (torch.randn(slots, 2 * inter, h, generator=g) * 0.2).to(dt)
    w2 = (torch.randn(slots, h, inter, generator=g) * 0.2).to(dt)
    got = torch_slots_gemm(x, weights, routes, w13, w2)
    want = moe_experts(x, weights, routes.long(), w13, w2)
    assert torch.equal(got, want)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 24), k=st.integers(1, 4), slots=st.integers(1, 9),
       dtype=st.sampled_from(["float32", "bfloat16"]), fp32_weights=st.booleans(),
       p_cpu=st.sampled_from([0.0, 0.3, 1.0]), seed=st.integers(0, 2**31 - 1))
def test_grouped_gemm_matches_the_reference_within_the_final_sum(n, k, slots, dtype, fp32_weights, p_cpu, seed):
    """The grouped GEMMs round every expert's terms where the reference does; only the sum of a
    token's K terms differs (fp32 once, against K roundings), so the gap is at most K roundings
    of the output's magnitude."""
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    h, inter = 16, 8
    x = torch.randn(n, h, generator=g).to(dt)
    weights = torch.rand(n, k, generator=g).to(torch.float32 if fp32_weights else dt)  # fp32: Mixtral's router
    routes = torch.randint(0, slots, (n, k), generator=g, dtype=torch.int32)
    routes[torch.rand(n, k, generator=g) < p_cpu] = -1
    w13 = (torch.randn(slots, 2 * inter, h, generator=g) * 0.2).to(dt)
    w2 = (torch.randn(slots, h, inter, generator=g) * 0.2).to(dt)
    got = grouped_slots_gemm(x, weights, routes, w13, w2)
    want = moe_experts(x, weights, routes.long(), w13, w2)
    eps = 2**-8 if dt == torch.bfloat16 else 2**-23
    bound = k * eps * float(want.abs().max()) + 1e-30
    assert float((got.float() - want.float()).abs().max()) <= bound
    assert torch.equal(got, grouped_slots_gemm(x, weights, routes, w13, w2))  # deterministic
    assert not got[(routes < 0).all(dim=1)].any()  # a token with every route elsewhere gets nothing
