"""gpt-oss's sinks through SDPA (models/sink_sdpa.py) on CUDA: a fused kernel takes it (the math
backend is refused here, so a silent fall back to materialised scores fails), and it agrees with
the reference's eager sink attention as on the CPU (tests/test_sink_sdpa.py)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from freetoken.models.sink_sdpa import sink_sdpa
from freetoken.reference.sink_attention import sink_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_gpt_oss_chunk_on_a_fused_kernel(window, dtype) -> None:
    """gpt-oss-120b's heads (64 queries, 8 keys/values, D 64), a 1024-token chunk after 512 cached keys."""
    g = torch.Generator(device="cuda").manual_seed(0)
    B, Hq, Hkv, T, Lk, D = 1, 64, 8, 1024, 1536, 64
    q = torch.randn(B, Hq, T, D, generator=g, device="cuda").to(dtype)
    keys, values = (torch.randn(B, Hkv, Lk, D, generator=g, device="cuda").to(dtype) for _ in range(2))
    sinks = torch.randn(Hq, generator=g, device="cuda").to(dtype) * 4
    query_pos = torch.arange(Lk - T, Lk, device="cuda")[None, None, :, None]
    key_pos = torch.arange(Lk, device="cuda")
    mask = key_pos <= query_pos
    if window is not None:
        mask = mask & (key_pos > query_pos - window)
    args = (q, keys, values, mask, sinks, D**-0.5)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        got = sink_sdpa(*args)
    exact = sink_attention(*(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args))
    ref = sink_attention(*args).float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, exact, rtol=1e-3, atol=1e-4)
    else:  # no farther from fp32 math than the reference's own bf16 roundings, and a bf16 ulp of slack
        assert (got.float() - exact).abs().max() <= (ref - exact).abs().max() + 2**-8 * exact.abs().max()
