"""gpt-oss's sinks as one more key through SDPA (models/sink_sdpa.py) against the reference's eager
sink attention (reference/sink_attention.py): fp32 to float error, bf16 within the reference's own
roundings; grouped heads, sliding windows, chunks after cached keys, sinks that dominate; and the
attention block taking it only for long chunks of the fused bundle."""

from __future__ import annotations

import pytest
import torch

from freetoken.models.sink_sdpa import MIN_QUERIES, sink_sdpa
from freetoken.reference.sink_attention import sink_attention


def _case(B, Hq, Hkv, T, Lk, D, window, sink_scale, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, T, D, generator=g).to(dtype)
    keys = torch.randn(B, Hkv, Lk, D, generator=g).to(dtype)
    values = torch.randn(B, Hkv, Lk, D, generator=g).to(dtype)
    sinks = (torch.randn(Hq, generator=g) * sink_scale).to(dtype)
    query_pos = torch.arange(Lk - T, Lk)[None, None, :, None]  # the chunk's last query sees every key
    key_pos = torch.arange(Lk)
    mask = (key_pos <= query_pos).expand(B, 1, T, Lk).clone()
    if window is not None:
        mask &= key_pos > query_pos - window
    return q, keys, values, mask, sinks, D**-0.5


@pytest.mark.parametrize("B,Hq,Hkv,T,Lk,D,window", [
    (1, 8, 2, 40, 40, 64, None),  # a prompt from position 0, grouped heads
    (1, 8, 2, 24, 70, 64, 16),  # a chunk after cached keys, sliding window
    (2, 4, 4, 9, 9, 48, 5),  # no grouping, a head dim whose E pads (49 -> 56)
    (1, 6, 3, 1, 33, 32, None),  # one query
])
@pytest.mark.parametrize("sink_scale", [1.0, 8.0])  # 8: sinks that take most of the softmax
def test_fp32_equals_the_reference(B, Hq, Hkv, T, Lk, D, window, sink_scale) -> None:
    args = _case(B, Hq, Hkv, T, Lk, D, window, sink_scale, torch.float32, seed=T + Lk)
    want, got = sink_attention(*args), sink_sdpa(*args)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


def test_bf16_within_the_references_roundings() -> None:
    """The reference rounds scores, scaled scores, shifted scores and probabilities to bf16; the
    fused path rounds once. Both against fp32 math on the same bf16 inputs: ours is no farther."""
    args = _case(1, 8, 2, 64, 96, 64, 32, 4.0, torch.bfloat16, seed=3)
    exact = sink_attention(*(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                             for a in args))
    ref, ours = sink_attention(*args).float(), sink_sdpa(*args).float()
    assert sink_sdpa(*args).dtype == torch.bfloat16
    ref_err, our_err = (ref - exact).abs().max(), (ours - exact).abs().max()
    assert our_err <= ref_err + 2**-8 * exact.abs().max(), (our_err, ref_err)


def test_every_key_masked_but_the_sink_gives_zero() -> None:
    """A row whose every real key is masked attends only the sink, whose value is zero (the reference
    gives the same: its masked scores are the dtype's lowest value)."""
    q, keys, values, mask, sinks, scale = _case(1, 4, 2, 3, 5, 32, None, 1.0, torch.float32, seed=1)
    mask[..., 1, :] = False
    got = sink_sdpa(q, keys, values, mask, sinks, scale)
    assert torch.equal(got[:, :, 1], torch.zeros_like(got[:, :, 1]))
    torch.testing.assert_close(got, sink_attention(q, keys, values, mask, sinks, scale), rtol=2e-5, atol=2e-6)


def test_the_attention_block_takes_it_for_long_chunks_only(monkeypatch) -> None:
    """models/attention.py: chunks of at least MIN_QUERIES queries go through the bundle's
    long_sink_attention; shorter ones (and every decode step) keep the reference."""
    from freetoken.models import attention
    from freetoken.models.ops import REFERENCE_OPS, fused_ops

    assert REFERENCE_OPS.long_sink_attention is None
    assert fused_ops().long_sink_attention is sink_sdpa
    seen = []

    def spy(name, fn):
        def wrapped(*args):
            seen.append((name, args[0].shape[2]))
            return fn(*args)
        return wrapped

    monkeypatch.setattr(attention, "sink_attention", spy("reference", sink_attention))
    ops = type(REFERENCE_OPS)(**{**vars(REFERENCE_OPS), "long_sink_attention": spy("sdpa", sink_sdpa)})

    class Block(attention.Attention):
        def __init__(self):
            self.ops, self.windows = ops, []

    class Pool:
        padded = False

        def write(self, layer, k, v):
            self.k, self.v = k, v

        def read(self, layer):
            return self.k, self.v

    for T in (MIN_QUERIES - 1, MIN_QUERIES):
        q, k, v = (torch.randn(1, T, h, 16) for h in (4, 2, 2))
        Block().attend(0, q, k, v, Pool(), torch.arange(T)[None], T, torch.zeros(4))
    assert seen == [("reference", MIN_QUERIES - 1), ("sdpa", MIN_QUERIES)]


def test_queries_in_slices_give_the_same_rows(monkeypatch) -> None:
    """Slices of a few queries each (SLICE_SCORES made small) give the one-call result."""
    from freetoken.models import sink_sdpa as module

    args = _case(1, 4, 2, 37, 50, 32, 9, 2.0, torch.float32, seed=5)
    whole = sink_sdpa(*args)
    monkeypatch.setattr(module, "SLICE_SCORES", 4 * 64 * 5)  # 5 queries a slice over 64 padded keys
    torch.testing.assert_close(module.sink_sdpa(*args), whole, rtol=1e-6, atol=1e-7)
