"""The GEMMs over cache slots an expert format computes with on the device: the Triton kernel
(kernels/triton/moe_gemm.py) for decode, the reference loop as its exact host-synchronising
twin, and two grouped GEMMs for long prefill chunks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# (x, weights, routes, w13, w2, landing=None) -> y; landing: the plan's copy_slots when the slot
# fill was launched just before (a scheduling hint for the Triton kernels, moe_slots_gemm; never
# changes the result)
GemmFn = Callable[..., torch.Tensor]


def torch_slots_gemm(x, weights, routes, w13, w2, landing=None, expert=None) -> torch.Tensor:
    """The reference expert loop (`reference.moe.moe_experts`), equal to it bit for bit, with
    one host synchronisation per call instead of one per expert: the routed pairs are sorted by
    slot once (stable, so each expert's pairs keep the row-major order `torch.where` gives the
    reference), and each expert takes its run of the sorted pairs.
    landing: not used (a launch-order hint for the Triton kernels).
    expert: one expert on its tokens, (x [n, H], w13[slot], w2[slot]) -> [n, H]; None: SwiGLU
    (`reference.moe.swiglu_expert`). An expert format with other math passes its own."""
    return expert_loop(x, weights, routes, w13.shape[0], lambda slot: (w13[slot], w2[slot]), expert)


def expert_loop(x, weights, routes, num_slots: int, expert_weights, expert=None) -> torch.Tensor:
    """`torch_slots_gemm` over any slot layout: expert_weights(slot) -> (w13 [2I, H], w2 [H, I]) in
    x's dtype (a quantized format dequantizes the slot's blocks there)."""
    from freetoken.reference.moe import swiglu_expert

    expert = swiglu_expert if expert is None else expert

    out = torch.zeros_like(x)  # [N, H]
    n, k = routes.shape
    flat = routes.flatten().long()  # [N*K], -1 = routed elsewhere
    keyed = torch.where(flat >= 0, flat, num_slots)  # unrouted pairs sort last
    order = torch.sort(keyed, stable=True).indices  # [N*K] pair indices grouped by slot
    counts = torch.bincount(keyed, minlength=num_slots + 1)[:num_slots].tolist()  # the one sync
    start = 0
    for slot, count in enumerate(counts):
        if not count:
            continue
        pairs = order[start : start + count]
        start += count
        token_idx, k_idx = pairs // k, pairs % k
        y = expert(x[token_idx], *expert_weights(slot))  # [count, H]
        y = y * weights[token_idx, k_idx, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def grouped_slots_gemm(x, weights, routes, w13, w2) -> torch.Tensor:
    """The expert loop for long prefill chunks as two grouped GEMMs (`torch._grouped_mm`: on
    SM90 and newer one kernel per bank for every expert at once, no host synchronisation;
    elsewhere torch's own fallback). The loop launches ~15 kernels per expert from Python,
    which at 128 experts a layer kept the host, not the copies or the GPU, the bottleneck of
    a streamed prefill.

    Rounding: each expert's gate/up product, activation, down product and weighting round to
    the activation dtype where the reference loop rounds; the K weighted terms of a token are
    then summed in fp32 and rounded once (the loop adds them one by one in the activation
    dtype), in a fixed order, so the result is deterministic and within the accumulation's
    rounding of `reference.moe.moe_experts` (tests/property/test_expert_loop.py).
    CUDA's grouped GEMM takes bf16 only: other dtypes on CUDA run the loop."""
    if x.is_cuda and x.dtype != torch.bfloat16:
        return torch_slots_gemm(x, weights, routes, w13, w2)
    n, k = routes.shape
    num_slots = w13.shape[0]
    flat = routes.flatten().long()  # [N*K], -1 = routed elsewhere
    keyed = torch.where(flat >= 0, flat, num_slots)  # unrouted pairs sort last
    order = torch.sort(keyed, stable=True).indices  # [P = N*K] pair indices grouped by slot
    ends = torch.bincount(keyed, minlength=num_slots + 1)[:num_slots].cumsum(0).to(torch.int32)  # [S]
    # Rows past ends[-1] (pairs routed elsewhere) belong to no group: undefined, masked below.
    # Temporaries are dropped as soon as they are used: at an 8k-token chunk each [P, H] one is
    # N*K*H elements (268 MB for qwen3-30b-a3b).
    h13 = torch._grouped_mm(x[order // k], w13.transpose(1, 2), offs=ends)  # [P, 2I]
    gate, up = h13.chunk(2, dim=-1)
    act = F.silu(gate).mul_(up)  # [P, I]
    del h13, gate, up
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=ends)  # [P, H]
    del act
    y.mul_(weights.flatten()[order, None])  # computed in the weights' precision, rounded to y's dtype
    y.masked_fill_((keyed[order] >= num_slots)[:, None], 0)
    pairs = torch.empty_like(y).index_copy_(0, order, y)  # [N*K, H] back in (token, k) order
    del y
    return pairs.view(n, k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)


def triton_slots_gemm(x, weights, routes, w13, w2, landing=None) -> torch.Tensor:
    from freetoken.kernels.triton.moe_gemm import moe_slots_gemm

    return moe_slots_gemm(x, weights, routes, w13, w2, landing=landing)
