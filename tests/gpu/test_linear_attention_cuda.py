"""The linear-attention kernels at Qwen3-Next / Qwen3.5's shapes on CUDA (bf16 inputs, fp32 state):
32 value heads, DK = DV = 128, conv channels 2*16*128 + 32*128 = 8192, W = 4; and a decode step
of both captured in a CUDA graph and replayed on new inputs over the same slot pools.

Skipped without CUDA (tests/gpu/conftest.py). Run with TRITON_INTERPRET unset.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels.registry import check_case
from freetoken.kernels.specs.common import per_dtype_compare
from freetoken.kernels.specs.linear_attention import GATED_DELTA_TOLERANCE, CausalConvCase, GatedDeltaCase

KEY_HEADS, HEADS, KEY_DIM, VALUE_DIM, CHANNELS, WIDTH = 16, 32, 128, 128, 8192, 4


@pytest.mark.parametrize("rule,batch,tokens", [
    ("gated_delta_recurrent", 1, 1), ("gated_delta_recurrent", 8, 1), ("gated_delta_recurrent", 2, 3),
    ("gated_delta_chunked", 1, 1000), ("gated_delta_chunked", 2, 130), ("gated_delta_chunked", 1, 64),
])
@pytest.mark.parametrize("decay", [0.1, 5.0])
def test_gated_delta_at_model_shapes(rule, batch, tokens, decay):
    case = GatedDeltaCase(batch, tokens, KEY_HEADS, KEY_DIM, VALUE_DIM, "bfloat16", decay, False, seed=tokens,
                          group=HEADS // KEY_HEADS)
    assert check_case(rule, case, "cuda") is None


@pytest.mark.parametrize("batch,tokens", [(1, 1), (8, 1), (1, 1000), (2, 3)])
def test_causal_conv_at_model_shapes(batch, tokens):
    assert check_case("causal_conv", CausalConvCase(batch, tokens, CHANNELS, WIDTH, "bfloat16", False, 1),
                      "cuda") is None


def test_dispatcher_continues_a_chunked_prefill_with_decode_steps():
    """A prefill through the chunked kernels, then decode steps through the recurrent one, equal the
    twin over the whole sequence: the two kernels hand the state on in the same layout."""
    from freetoken.kernels.triton.gated_delta import gated_delta_rule
    from freetoken.reference.gated_delta import gated_delta_rule as twin

    q, k, v, g, beta, pool, slots = GatedDeltaCase(2, 200, HEADS, KEY_DIM, VALUE_DIM, "bfloat16", 1.0, True,
                                                   7).inputs()
    want_pool = pool.clone()
    want = twin(q, k, v, g, beta, want_pool, slots)
    dev = [t.cuda() for t in (q, k, v, g, beta)]
    got_pool, dev_slots = pool.cuda(), slots.cuda()
    parts = [gated_delta_rule(*(t[:, :197] for t in dev), got_pool, dev_slots)]
    parts += [gated_delta_rule(*(t[:, i:i + 1] for t in dev), got_pool, dev_slots) for i in range(197, 200)]
    got = torch.cat(parts, dim=1).cpu()
    assert per_dtype_compare([got, got_pool.cpu()], [want, want_pool], GATED_DELTA_TOLERANCE) is None

def test_decode_step_replays_in_a_cuda_graph():
    """Conv then gated delta, one token for 4 sequences in slots 6, 1, 3, 0 of 8, captured once and
    replayed twice on new inputs: the same outputs and pools as eager calls on the same inputs."""
    from freetoken.kernels.triton.causal_conv import causal_conv1d
    from freetoken.kernels.triton.gated_delta import gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    B, S = 4, 8
    slots = torch.tensor([6, 1, 3, 0], device="cuda")
    weight = (torch.randn(CHANNELS, WIDTH, generator=gen) / 2).bfloat16().cuda()

    def fresh_inputs():
        x = torch.randn(B, 1, CHANNELS, generator=gen).bfloat16().cuda()
        g = (-torch.rand(B, 1, HEADS, generator=gen)).cuda()
        beta = torch.rand(B, 1, HEADS, generator=gen).bfloat16().cuda()
        return x, g, beta

    def step(x, g, beta, conv_pool, state_pool):
        y = causal_conv1d(x, weight, conv_pool, slots)  # [B, 1, C]: q | k | v, as the model splits it
        q, k, v = y.split([KEY_HEADS * KEY_DIM, KEY_HEADS * KEY_DIM, HEADS * VALUE_DIM], dim=2)
        q, k = (t.reshape(B, 1, KEY_HEADS, KEY_DIM).repeat_interleave(HEADS // KEY_HEADS, dim=2) for t in (q, k))
        v = v.reshape(B, 1, HEADS, VALUE_DIM)  # a strided view: the kernel reads it in place
        return gated_delta_rule(q, k, v, g, beta, state_pool, slots)

    conv_pool = torch.randn(S, CHANNELS, WIDTH - 1, generator=gen).bfloat16().cuda()
    state_pool = torch.randn(S, HEADS, KEY_DIM, VALUE_DIM, generator=gen).cuda()
    eager_conv, eager_state = conv_pool.clone(), state_pool.clone()
    static = fresh_inputs()
    step(*static, conv_pool.clone(), state_pool.clone())  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(*static, conv_pool, state_pool)
    for _ in range(2):
        inputs = fresh_inputs()
        for buffer, value in zip(static, inputs, strict=True):
            buffer.copy_(value)
        graph.replay()
        want = step(*inputs, eager_conv, eager_state)
        torch.cuda.synchronize()
        assert torch.equal(static_out, want)
        assert torch.equal(conv_pool, eager_conv) and torch.equal(state_pool, eager_state)
