"""The dense operations a decoder computes with, as one bundle: the reference twins, or the fused
kernels the engine runs on CUDA (each paired with its twin in kernels/specs/).

A model takes one `DenseOps`, so what it computes with is chosen in one place, and a new fused op
is one new field with its reference entry beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch.nn.functional as F

from freetoken.reference.causal_conv import causal_conv1d
from freetoken.reference.gated_delta import delta_gates, gated_delta_rule
from freetoken.reference.moe import route
from freetoken.reference.norms import add_rms_norm, gated_rms_norm, rms_norm
from freetoken.reference.rotary import Rotary


@dataclass(frozen=True)
class DecodeKernels:
    """One-token steps' fused path (kernels/triton/): the attention from the fused q/k/v
    projection (needs `AttentionWeights.fuse_qkv`), and the norms inside the linear layers after them."""

    project: Callable  # (x [B, in], w, bias) -> [B, out]: the attention's output projection
    qkv_prep: Callable  # decode_attention.qkv_prep: q/k norms, rotary and the KV pool write
    attend: Callable  # decode_attention.decode_attention: attention over the paged pool
    norm_project: Callable  # (h, delta, norm_w, eps, wqkv, bqkv) -> (h, qkv): input norm inside the q/k/v projection
    norm_router: Callable  # (h, delta, norm_w, eps, router_w) -> (h, x, logits): add + norm inside the router


@dataclass(frozen=True)
class DenseOps:
    rms_norm: Callable  # (x, weight, eps) -> normed x
    add_rms_norm: Callable  # (x, residual, weight, eps) -> (sum, normed sum)
    rotate: Callable  # (x [B, T, heads, D], cos, sin [B, T, D]) -> rotated x
    route: Callable  # (logits [N, E], top_k, renormalize, weights_fp32) -> (weights, ids [N, K])
    router_linear: Callable  # (x [N, H], router [E, H], bias [E] | None) -> logits [N, E], rounded once
    decode: DecodeKernels | None = None  # None: one-token steps take the same path as the others
    # Linear attention (models/gated_deltanet.py): the twins here, their Triton kernels in fused_ops().
    causal_conv: Callable = causal_conv1d  # (x [B, T, C], weight [C, W], conv_pool, slots) -> silu(conv) [B, T, C]
    gated_delta: Callable = gated_delta_rule  # (q, k [.., HK, DK], v, g, beta, state_pool, slots) -> [B, T, HV, DV]
    gated_rms_norm: Callable = gated_rms_norm  # (x, gate, weight, eps) -> normed x * silu(gate)
    delta_gates: Callable = delta_gates  # (b, a [B, T, HV], A_log, dt_bias) -> (g fp32, beta)
    # gpt-oss's attention with sinks for long prefill chunks (models/sink_sdpa.py); None: the
    # reference's eager rounding points everywhere
    long_sink_attention: Callable | None = None  # reference.sink_attention's contract


REFERENCE_OPS = DenseOps(rms_norm=rms_norm, add_rms_norm=add_rms_norm, rotate=Rotary.apply, route=route,
                         router_linear=F.linear)


def fused_ops() -> DenseOps:
    """The dense operations as fused kernels: one kernel each where the reference ops launch many,
    since launches dominate a decode step's dense part. (Imported on call: the reference path
    needs no Triton.)"""
    from freetoken.kernels.triton.causal_conv import causal_conv1d as fused_causal_conv
    from freetoken.kernels.triton.decode_attention import decode_attention, qkv_prep
    from freetoken.kernels.triton.decode_linear import linear, projection
    from freetoken.kernels.triton.delta_gates import delta_gates as fused_delta_gates
    from freetoken.kernels.triton.gated_delta import gated_delta_rule as fused_gated_delta
    from freetoken.kernels.triton.norm_linear import norm_project, norm_router
    from freetoken.kernels.triton.rms_norm import fused_add_rms_norm, fused_gated_rms_norm, fused_rms_norm
    from freetoken.kernels.triton.rotary import fused_rotary
    from freetoken.kernels.triton.routing import fused_route
    from freetoken.models.sink_sdpa import sink_sdpa

    decode = DecodeKernels(project=projection, qkv_prep=qkv_prep, attend=decode_attention,
                           norm_project=norm_project, norm_router=norm_router)
    return DenseOps(rms_norm=fused_rms_norm, add_rms_norm=fused_add_rms_norm, rotate=fused_rotary,
                    route=fused_route, router_linear=linear, decode=decode, causal_conv=fused_causal_conv,
                    gated_delta=fused_gated_delta, gated_rms_norm=fused_gated_rms_norm, delta_gates=fused_delta_gates,
                    long_sink_attention=sink_sdpa)


def with_family_norms(ops: DenseOps, zero_centred: bool, rounded_once: bool) -> DenseOps:
    """ops with the norms a family computes: weights stored zero-centred (scaled by 1 + w), or
    the weight applied before the one rounding; the fused kernels' variants where `ops` are fused."""
    if not (zero_centred or rounded_once):
        return ops
    if ops.rms_norm is rms_norm:  # the reference ops
        from freetoken.reference import norms as n

        norm, add_norm = ((n.offset_rms_norm, n.offset_add_rms_norm) if zero_centred
                          else (n.rms_norm_rounded_once, n.add_rms_norm_rounded_once))
    else:
        from freetoken.kernels.triton import rms_norm as k

        norm, add_norm = ((k.fused_offset_rms_norm, k.fused_offset_add_rms_norm) if zero_centred
                          else (k.fused_rms_norm_rounded_once, k.fused_add_rms_norm_rounded_once))
    return replace(ops, rms_norm=norm, add_rms_norm=add_norm)
