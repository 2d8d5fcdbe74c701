"""The Gated DeltaNet's per-token gates in one kernel: the log decay g = -exp(A_log) *
softplus(a + dt_bias) in fp32 and beta = sigmoid(b), from the layer's b and a projections (the
torch expression launches about nine kernels a layer, most of a decode step's work there).

Shape legend: N = B*T token rows, HV value heads.
Twin: `freetoken.reference.gated_delta.delta_gates`; pair in kernels/specs/linear_attention.py.
softplus is torch's (the input itself above 20); log1p(e) is log(1 + e) * e / ((1 + e) - 1), which
keeps the digits of a small e that 1 + e rounds away; exp and log may differ from torch's in their
last bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton.rounding import store_rounded


@triton.jit
def _gates_kernel(b_ptr, a_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, HV, sb_n, sa_n,
                  BLOCK: tl.constexpr, BETA_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HV
    b = tl.load(b_ptr + row * sb_n + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + row * sa_n + offs, mask=mask, other=0.0).to(tl.float32)
    x = a + tl.load(dt_bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e  # log1p(e) = log(u) * e / (u - 1): exact to a few ulps where u rounds e away
    exact = u == 1.0
    softplus = tl.where(x > 20.0, x, tl.where(exact, e, tl.log(u) * (e / tl.where(exact, 1.0, u - 1.0))))
    rate = tl.exp(tl.load(a_log_ptr + offs, mask=mask, other=0.0).to(tl.float32))
    tl.store(g_ptr + row * HV + offs, -rate * softplus, mask=mask)
    store_rounded(beta_ptr + row * HV + offs, 1.0 / (1.0 + tl.exp(-b)), mask, BETA_BF16)


def delta_gates(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor,
                dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """b, a [B, T, HV] (bf16 or fp32; the last dim contiguous, rows may be strided: views of one
    projection); A_log, dt_bias [HV] -> (g [B, T, HV] fp32, beta [B, T, HV] in b's dtype)."""
    if b.shape != a.shape or b.dim() != 3 or A_log.shape != (b.shape[2],) or dt_bias.shape != A_log.shape:
        raise ValueError(f"delta_gates: b {tuple(b.shape)}, a {tuple(a.shape)} must be [B, T, HV] and A_log "
                         f"{tuple(A_log.shape)}, dt_bias {tuple(dt_bias.shape)} [HV]")
    if b.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"delta_gates: b is {b.dtype}; bfloat16 or float32 expected")
    B, T, HV = b.shape
    rows_b, rows_a = b.reshape(B * T, HV), a.reshape(B * T, HV)  # (views where the rows are evenly strided)
    if rows_b.stride(1) != 1 or rows_a.stride(1) != 1:
        rows_b, rows_a = rows_b.contiguous(), rows_a.contiguous()
    g = torch.empty(B, T, HV, dtype=torch.float32, device=b.device)
    beta = torch.empty(B, T, HV, dtype=b.dtype, device=b.device)
    _gates_kernel[(B * T,)](rows_b, rows_a, A_log.contiguous(), dt_bias.contiguous(), g, beta, HV,
                            rows_b.stride(0), rows_a.stride(0), BLOCK=triton.next_power_of_2(HV),
                            BETA_BF16=b.dtype == torch.bfloat16, num_warps=1)
    return g, beta
