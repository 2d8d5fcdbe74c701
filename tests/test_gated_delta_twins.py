"""The linear-attention twins (reference/gated_delta.py, reference/causal_conv.py) against
transformers' torch paths: Qwen3-Next's recurrent and chunked gated delta rule, and a grouped
conv1d over [state, x] then SiLU; fp32 throughout, so only summation order separates them."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from freetoken.reference.causal_conv import causal_conv1d
from freetoken.reference.gated_delta import gated_delta_rule

# (B, T, HV, DK, DV): decode (T=1), T not a multiple of the 64-token chunk, more than one chunk.
SHAPES = [(1, 1, 2, 16, 16), (3, 1, 4, 32, 16), (2, 5, 2, 16, 32), (1, 70, 2, 16, 16), (2, 130, 1, 8, 8)]


def _inputs(B: int, T: int, HV: int, DK: int, DV: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, HV, DK, generator=gen)
    k = torch.randn(B, T, HV, DK, generator=gen)
    v = torch.randn(B, T, HV, DV, generator=gen)
    g = -torch.rand(B, T, HV, generator=gen) * 2  # log decays in (-2, 0]
    beta = torch.rand(B, T, HV, generator=gen)
    state = torch.randn(B, HV, DK, DV, generator=gen) * 0.5
    return q, k, v, g, beta, state


def _pool_with(state: torch.Tensor, slots: torch.Tensor, size: int) -> torch.Tensor:
    pool = torch.full((size, *state.shape[1:]), float("nan"))  # unread rows stay NaN: reading one shows
    pool[slots] = state
    return pool


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("hf_rule", ["recurrent", "chunk"])
def test_gated_delta_matches_transformers(shape, hf_rule):
    B = shape[0]
    q, k, v, g, beta, state = _inputs(*shape, seed=sum(shape))
    slots = torch.tensor([5, 1, 3][:B], dtype=torch.int64)  # not contiguous, not in order
    pool = _pool_with(state, slots, size=7)
    rule = hf.torch_recurrent_gated_delta_rule if hf_rule == "recurrent" else hf.torch_chunk_gated_delta_rule
    want, want_state = rule(q, k, v, g, beta, initial_state=state.clone(), output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
    got = gated_delta_rule(q, k, v, g, beta, pool, slots)
    assert got.dtype == v.dtype and got.shape == v.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool[slots], want_state, rtol=1e-4, atol=1e-5)
    assert pool[[0, 2, 4, 6]].isnan().all()  # other sequences' slots neither read nor written


def test_gated_delta_fresh_slot_is_no_initial_state():
    q, k, v, g, beta, _ = _inputs(1, 9, 2, 16, 16, seed=3)
    want, want_state = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                                           use_qk_l2norm_in_kernel=True)
    pool = torch.zeros(2, 2, 16, 16)
    got = gated_delta_rule(q, k, v, g, beta, pool, torch.tensor([1]))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool[1], want_state[0], rtol=1e-4, atol=1e-5)
    assert (pool[0] == 0).all()


def test_gated_delta_two_calls_equal_one():
    q, k, v, g, beta, state = _inputs(2, 23, 2, 16, 8, seed=11)
    slots = torch.tensor([2, 0])
    whole, split = _pool_with(state, slots, 3), _pool_with(state, slots, 3)
    want = gated_delta_rule(q, k, v, g, beta, whole, slots)
    parts = [gated_delta_rule(*(t[:, span] for t in (q, k, v, g, beta)), split, slots)
             for span in (slice(0, 17), slice(17, 23))]
    torch.testing.assert_close(torch.cat(parts, dim=1), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(split[slots], whole[slots], rtol=1e-5, atol=1e-6)


def test_read_only_rows_start_from_their_slot_and_write_nothing():
    """A captured step's padding rows: -(s + 1) computes what a row in slot s computes, and both
    the delta rule's and the conv's pools keep slot s as it was."""
    q, k, v, g, beta, state = _inputs(2, 3, 2, 16, 8, seed=13)
    written, read_only = _pool_with(state, torch.tensor([2, 0]), 3), _pool_with(state, torch.tensor([2, 0]), 3)
    want = gated_delta_rule(q, k, v, g, beta, written, torch.tensor([2, 0]))
    got = gated_delta_rule(q, k, v, g, beta, read_only, torch.tensor([2, -1]))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(read_only[2], written[2], rtol=0, atol=0)
    torch.testing.assert_close(read_only[0], state[1], rtol=0, atol=0)
    gen = torch.Generator().manual_seed(4)
    x, weight, conv = torch.randn(2, 1, 8, generator=gen), torch.randn(8, 4, generator=gen), torch.randn(3, 8, 3)
    conv_written, conv_read_only = conv.clone(), conv.clone()
    want = causal_conv1d(x, weight, conv_written, torch.tensor([1, 2]))
    got = causal_conv1d(x, weight, conv_read_only, torch.tensor([1, -3]))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(conv_read_only[1], conv_written[1], rtol=0, atol=0)
    torch.testing.assert_close(conv_read_only[2], conv[2], rtol=0, atol=0)


def test_two_rows_writing_one_slot_are_refused_a_read_only_one_is_not():
    q, k, v, g, beta, state = _inputs(2, 1, 2, 16, 8, seed=1)
    with pytest.raises(ValueError, match="write a slot more than once"):
        gated_delta_rule(q, k, v, g, beta, _pool_with(state, torch.tensor([0, 1]), 2), torch.tensor([1, 1]))
    gated_delta_rule(q, k, v, g, beta, _pool_with(state, torch.tensor([0, 1]), 2), torch.tensor([1, -2]))


def test_key_heads_serve_groups_of_value_heads():
    """q/k with HK heads equal q/k repeated to the HV value heads (key head h // r serves value head h)."""
    q, k, v, g, beta, state = _inputs(2, 5, 4, 16, 8, seed=21)
    q, k = q[:, :, :2], k[:, :, :2]  # 2 key heads for 4 value heads
    slots = torch.tensor([1, 0])
    grouped, repeated = _pool_with(state, slots, 2), _pool_with(state, slots, 2)
    got = gated_delta_rule(q, k, v, g, beta, grouped, slots)
    want = gated_delta_rule(q.repeat_interleave(2, 2), k.repeat_interleave(2, 2), v, g, beta, repeated, slots)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(grouped, repeated, rtol=0, atol=0)
    with pytest.raises(ValueError, match="multiple of HK"):
        gated_delta_rule(q[:, :, :1].repeat(1, 1, 3, 1), k[:, :, :1].repeat(1, 1, 3, 1), v, g, beta, grouped, slots)


def test_gated_delta_bf16_inputs_give_bf16_out():
    q, k, v, g, beta, state = (t.bfloat16() for t in _inputs(1, 4, 2, 16, 16, seed=5))
    pool = state.float().clone()
    out = gated_delta_rule(q, k, v, g.float(), beta, pool, torch.tensor([0]))
    assert out.dtype == torch.bfloat16 and pool.dtype == torch.float32


def test_gated_delta_names_the_bad_argument():
    q, k, v, g, beta, state = _inputs(2, 3, 2, 16, 16, seed=1)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="state_pool"):
        gated_delta_rule(q, k, v, g, beta, state.half(), slots)
    with pytest.raises(ValueError, match="slots"):
        gated_delta_rule(q, k, v, g, beta, state, slots.int())
    with pytest.raises(ValueError, match="beta"):
        gated_delta_rule(q, k, v, g, beta[:, :2], state, slots)
    with pytest.raises(ValueError, match="more than once"):
        gated_delta_rule(q, k, v, g, beta, state, torch.tensor([1, 1]))


def _conv_reference(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(conv1d(groups=C)) over [state, x], and the new state: the last W-1 inputs."""
    C = x.shape[2]
    inputs = torch.cat([state, x.transpose(1, 2)], dim=2)  # [B, C, W-1+T]
    y = torch.nn.functional.conv1d(inputs, weight[:, None, :], groups=C)  # [B, C, T]
    return torch.nn.functional.silu(y).transpose(1, 2), inputs[:, :, -state.shape[2]:]


@pytest.mark.parametrize("B,T,C,W", [(1, 1, 8, 4), (3, 1, 24, 4), (2, 7, 16, 4), (1, 70, 8, 2), (2, 2, 8, 4)])
def test_causal_conv_matches_conv1d(B, T, C, W):
    gen = torch.Generator().manual_seed(B * 100 + T)
    x = torch.randn(B, T, C, generator=gen)
    weight = torch.randn(C, W, generator=gen)
    state = torch.randn(B, C, W - 1, generator=gen)
    slots = torch.tensor([4, 0, 2][:B])
    pool = _pool_with(state, slots, size=5)
    want, want_state = _conv_reference(x, weight, state)
    got = causal_conv1d(x, weight, pool, slots)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool[slots], want_state, rtol=0, atol=0)
    assert pool[[1, 3]].isnan().all()


def test_causal_conv_matches_transformers_prefill_from_fresh_state():
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(2, 9, 16, generator=gen), torch.randn(16, 4, generator=gen)
    want = hf.causal_conv1d_fn(x.transpose(1, 2), weight, activation="silu").transpose(1, 2)
    got = causal_conv1d(x, weight, torch.zeros(2, 16, 3), torch.tensor([0, 1]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_causal_conv_two_calls_equal_one():
    gen = torch.Generator().manual_seed(2)
    x, weight = torch.randn(2, 11, 8, generator=gen), torch.randn(8, 4, generator=gen)
    slots = torch.tensor([1, 0])
    whole, split = torch.zeros(2, 8, 3), torch.zeros(2, 8, 3)
    want = causal_conv1d(x, weight, whole, slots)
    # a 2-token chunk is shorter than the state: the new state mixes old state and new inputs
    parts = [causal_conv1d(x[:, span], weight, split, slots) for span in (slice(0, 6), slice(6, 8), slice(8, 11))]
    # the same sums tap by tap, but torch's vectorised CPU kernels (SiLU's exp) may round a
    # tensor's tail lanes differently from its body by an ulp, and the chunks have other tails
    torch.testing.assert_close(torch.cat(parts, dim=1), want, rtol=2.5e-7, atol=0)
    torch.testing.assert_close(split, whole, rtol=0, atol=0)


def test_causal_conv_names_the_bad_argument():
    x, weight = torch.randn(1, 3, 8), torch.randn(8, 4)
    with pytest.raises(ValueError, match="conv_pool"):
        causal_conv1d(x, weight, torch.zeros(1, 8, 4), torch.tensor([0]))
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, torch.randn(4, 8), torch.zeros(1, 8, 3), torch.tensor([0]))
    with pytest.raises(ValueError, match="more than once"):
        causal_conv1d(x.expand(2, 3, 8), weight, torch.zeros(2, 8, 3), torch.tensor([0, 0]))
