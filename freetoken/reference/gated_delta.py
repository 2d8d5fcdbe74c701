"""Reference semantics of the gated delta rule, the linear attention of Qwen3-Next / Qwen3.5
(twin of kernels/triton/gated_delta.py).

Shape legend: B sequences, T tokens per sequence, HK key heads, each serving HV / HK value heads
(key head h // (HV / HK) serves value head h), DK key dim, DV value dim, S state slots in the pool.

Per sequence and head, with q and k l2-normalised in fp32 (eps 1e-6 inside the rsqrt) and q then
scaled by DK**-0.5, each token t does, on the state S [DK, DV]:
    S      <- S * exp(g_t)                        (decay; g <= 0 is a log decay)
    delta  <- beta_t * (v_t - S^T k_t)            (what the state fails to predict, scaled)
    S      <- S + k_t delta^T                     (the delta-rule write)
    out_t  <- S^T q_t
This is the token-by-token recurrence, in fp32: the clearest statement of what the chunked form
(the kernel's prefill) computes in another order. The state lives in a pool indexed by slot so a
captured CUDA graph can replay a step on whichever sequences hold the slots; it is read as the
initial state and overwritten with the final one.

A slot s >= 0 names a row that reads slot s and writes its final state back; -(s + 1) names a
read-only row, which starts from slot s and writes nothing: a captured decode step's padding rows
(they compute row 0's step again, and must not write its state twice).
"""

from __future__ import annotations

import torch

L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, in fp32 (the eps sits inside the root)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def check_gated_delta_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor) -> None:
    """Raise ValueError naming the first argument whose shape or dtype does not fit the others."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"gated_delta_rule: q {tuple(q.shape)} and k {tuple(k.shape)} must both be [B, T, HK, DK]")
    B, T, HK, DK = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T) or v.shape[2] % HK != 0:
        raise ValueError(f"gated_delta_rule: v {tuple(v.shape)} must be [B={B}, T={T}, HV (a multiple of HK={HK}), DV]")
    HV = v.shape[2]
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (B, T, HV):
            raise ValueError(f"gated_delta_rule: {name} {tuple(t.shape)} must be [B={B}, T={T}, HV={HV}]")
    DV = v.shape[3]
    if state_pool.dim() != 4 or state_pool.shape[1:] != (HV, DK, DV) or state_pool.dtype != torch.float32:
        raise ValueError(f"gated_delta_rule: state_pool {state_pool.dtype}{tuple(state_pool.shape)} must be "
                         f"float32 [S, HV={HV}, DK={DK}, DV={DV}]")
    if slots.shape != (B,) or slots.dtype != torch.int64:
        raise ValueError(f"gated_delta_rule: slots {slots.dtype}{tuple(slots.shape)} must be int64 [B={B}]")


def read_slots(slots: torch.Tensor) -> torch.Tensor:
    """The slot each row starts from: s for a written row s, and for a read-only row -(s + 1)."""
    return torch.where(slots < 0, -slots - 1, slots)


def check_distinct_slots(op: str, slots: torch.Tensor) -> None:
    """Two sequences writing one slot would both read it and leave only one's state. The kernels
    cannot check this without a device sync (a captured step has none), so the twin states the
    contract. (A read-only row may start from a slot another row writes: the kernels may then give
    it either state; its caller discards what it computes.)"""
    written = slots[slots >= 0]
    if written.unique().numel() != written.numel():
        raise ValueError(f"{op}: slots {slots.tolist()} write a slot more than once")


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """q, k [B, T, HK, DK]; v [B, T, HV, DV]; g, beta [B, T, HV]; state_pool [S, HV, DK, DV] fp32
    (rows `slots` [B] read, then overwritten in place; negative: read-only rows) -> out [B, T, HV, DV] in v's dtype."""
    check_gated_delta_inputs(q, k, v, g, beta, state_pool, slots)
    check_distinct_slots("gated_delta_rule", slots)
    T, DK, out_dtype = q.shape[1], q.shape[3], v.dtype
    group = v.shape[2] // q.shape[2]
    q = l2_normalize(q.repeat_interleave(group, dim=2)) * DK**-0.5  # [B, T, HV, DK]
    k = l2_normalize(k.repeat_interleave(group, dim=2))
    v, decay, beta = v.float(), g.float().exp(), beta.float()
    state = state_pool[read_slots(slots)].clone()  # [B, HV, DK, DV]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)  # [B, T, HV, DV]
    for t in range(T):
        state = state * decay[:, t, :, None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])  # [B, HV, DV]
        delta = (v[:, t] - predicted) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
    written = slots >= 0
    state_pool[slots[written]] = state[written]
    return out.to(out_dtype)


def delta_gates(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor,
                dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule's per-token gates from the layer's b and a projections [B, T, HV]:
    g = -exp(A_log) * softplus(a + dt_bias) in fp32 (the log decay), and beta = sigmoid(b) in b's
    dtype -> (g, beta), as transformers' Qwen3-Next / Qwen3.5 compute them."""
    beta = torch.sigmoid(b)
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
    return g, beta
