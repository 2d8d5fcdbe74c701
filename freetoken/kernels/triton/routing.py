"""Fused MoE routing: one kernel for the router's softmax, top-k, renormalisation and cast.

Shape legend: N tokens, E experts (up to 1024, padded to a power of two with -inf), K top-k
(up to 32).
Twin: `freetoken.reference.moe.route_by_logits`, which equals `route` bit for bit wherever the
fp32 probabilities have no ties. The experts are chosen on the logits widened to fp32 (softmax
is monotonic), by K rounds of argmax over an order-preserving integer key, ties to the lower
expert id: only comparisons decide the ids, so they are exact on every backend.
Rounding points are the twin's: p = exp(l - max) / (sum over all E of exp(l - max)) in fp32, the
division correctly rounded; when renormalising, p / (sum of the K chosen p, added k = 0..K-1);
then the store (bf16 through `rne_bf16`, since the interpreter's cast truncates). What differs
is exp's last bits, the order of the sums and how torch's softmax divides: fp32 weights agree
within 2^-20 relative (the registered cases, and E 1024 with K 32, stay well inside it in the
interpreter), so bf16 weights within one ulp (registered in kernels/specs/dense.py).
exp: on CUDA libdevice's expf (2 ulp at most, over the whole range), not `tl.exp`, which lowers
to ex2.approx of x * log2(e) and so loses bits as |l - max| grows. The interpreter has no
libdevice; there `tl.exp` is numpy's fp32 exp, not correctly rounded either.
Why: in a decode step the reference is ~7 launches per MoE layer (softmax, topk, sum, divide,
cast); this is one, one program per token row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from freetoken.kernels.triton import pdl
from freetoken.kernels.triton.rounding import rne_bf16

MAX_EXPERTS = 1024
MAX_TOP_K = 32
_TAKEN = tl.constexpr(-(2**31))  # below the key of every float, -inf and NaNs included


@triton.jit
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    E,
    K,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORM: tl.constexpr,
    OUT_BF16: tl.constexpr,
    ACCURATE_EXP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    logits = tl.load(logits_ptr + row * E + offs, mask=mask, other=float("-inf")).to(tl.float32)
    shifted = logits - tl.max(logits, axis=0)
    if ACCURATE_EXP:
        e = libdevice.exp(shifted)
    else:
        e = tl.exp(shifted)
    total = tl.sum(e, axis=0)  # the padding's exp(-inf) adds zeros
    # An int32 key ordered as the floats are: negative floats get their magnitude bits flipped;
    # -0.0 becomes +0.0 first, so that equal floats have equal keys and tie to the lower id.
    bits = tl.where(logits == 0.0, 0.0, logits).to(tl.int32, bitcast=True)
    key = tl.where(mask, bits ^ ((bits >> 31) & 0x7FFFFFFF), _TAKEN)
    k_offs = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    chosen_sum = 0.0
    for k in range(K):  # K <= E real keys, so each round finds one not taken (> _TAKEN)
        idx = tl.argmax(key, axis=0, tie_break_left=True)
        p = tl.div_rn(tl.sum(tl.where(offs == idx, e, 0.0), axis=0), total)
        chosen_sum += p
        w = tl.where(k_offs == k, p, w)
        ids = tl.where(k_offs == k, idx, ids)
        key = tl.where(offs == idx, _TAKEN, key)
    if RENORM:
        w = tl.div_rn(w, tl.broadcast_to(chosen_sum, [BLOCK_K]))
    k_mask = k_offs < K
    tl.store(ids_ptr + row * K + k_offs, ids.to(tl.int64), mask=k_mask)
    if OUT_BF16:
        tl.store(weights_ptr + row * K + k_offs, rne_bf16(w), mask=k_mask)
    else:
        tl.store(weights_ptr + row * K + k_offs, w, mask=k_mask)


# libdevice only exists when compiling; the interpreter runs Python (numpy's exp behind tl.exp).
_ACCURATE_EXP = isinstance(_route_kernel, triton.runtime.JITFunction)


def fused_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_fp32: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [N, E] (bf16 or fp32) -> (weights [N, K], expert ids [N, K] int64).

    Weights are fp32 when `weights_fp32`, else of the logits' dtype; `route`'s signature."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [N, E], got shape {tuple(router_logits.shape)}")
    if router_logits.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"fused_route takes bfloat16 or float32 logits, got {router_logits.dtype}")
    n, e = router_logits.shape
    if not 1 <= e <= MAX_EXPERTS:
        raise ValueError(f"fused_route takes 1..{MAX_EXPERTS} experts, got {e}")
    if not 1 <= top_k <= min(e, MAX_TOP_K):
        raise ValueError(f"top_k must be in 1..{min(e, MAX_TOP_K)} for {e} experts, got {top_k}")
    out_dtype = torch.float32 if weights_fp32 else router_logits.dtype
    weights = torch.empty(n, top_k, dtype=out_dtype, device=router_logits.device)
    ids = torch.empty(n, top_k, dtype=torch.int64, device=router_logits.device)
    if n == 0:
        return weights, ids
    block_e = triton.next_power_of_2(e)
    _route_kernel[(n,)](
        router_logits.contiguous(),
        weights,
        ids,
        e,
        top_k,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        RENORM=bool(renormalize),
        OUT_BF16=out_dtype == torch.bfloat16,
        ACCURATE_EXP=_ACCURATE_EXP,
        num_warps=1 if block_e <= 256 else 4,
        **pdl.launch(weights),
    )
    return weights, ids
