"""A decode step's router in one launch: the logits, then softmax, top-k and renormalisation.

Shape legend: M rows (one token per sequence, 1..MAX_ROWS), H hidden, E experts, K top-k.
Twin: the two kernels it joins, whose bodies it runs unchanged: `decode_linear` for the logits
(each program its block of E), then `fused_route` for the routing, done by whichever program
finishes its logits last. Against those two launches it gives the same logits and experts bit
for bit; the weights' fp32 sums run over this launch's warps (4 or 8, against the routing
kernel's 1), so their last bits may differ, within route's bound (tests/property/
test_decode_router.py). The registered pair (kernels/specs/router.py) holds it to the twins:
the logits within decode_linear's tolerance of fp32 sums, the routing of its own logits as
`route_by_logits` routes them.

Why: the router's linear and its routing were two launches per MoE layer, each of them mostly
latency; inside a captured step every launch boundary costs ~1.2 us on the H200
(BENCHMARKS.md, where a step's device time goes).

How the last program knows it is last: each program's threads store their logits, meet at a
barrier, and one atomic add on a per-device counter (acquire-release, device scope) counts the
program in; the program that counts itself in last sees every other program's logits, routes
every row and puts the counter back to zero for the next launch. Launches that share a counter
must not overlap: the engine runs one forward at a time on one stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton.decode_linear import MAX_ROWS, check_decode_linear, linear, linear_block, linear_blocks
from freetoken.kernels.triton.routing import fused_route, route_constants, route_outputs, route_row

_counters: dict[torch.device, torch.Tensor] = {}  # one int32 per device, zero between launches


@triton.jit
def _router_kernel(x_ptr, w_ptr, logits_ptr, weights_ptr, ids_ptr, counter_ptr, M, E, H, K,
                   ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, OUT_BF16_LOGITS: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORM: tl.constexpr, OUT_BF16: tl.constexpr,
                   ACCURATE_EXP: tl.constexpr):
    linear_block(x_ptr, w_ptr, w_ptr, logits_ptr, tl.program_id(0), M, E, H, ROWS, BLOCK_N, BLOCK_H, False,
                 OUT_BF16_LOGITS)
    tl.debug_barrier()  # every thread's logits stored before the program counts itself in
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        for row in range(M):
            route_row(logits_ptr, weights_ptr, ids_ptr, row, E, K, BLOCK_E, BLOCK_K, RENORM, OUT_BF16, ACCURATE_EXP)
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


def _counter(device: torch.device) -> torch.Tensor:
    if device not in _counters:
        with torch.inference_mode(False):  # (kept across forwards, which run in inference mode)
            _counters[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _counters[device]


def decode_router(x: torch.Tensor, w: torch.Tensor, top_k: int, renormalize: bool, weights_fp32: bool,
                  blocks: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., H] with at most MAX_ROWS rows, w [E, H] (contiguous, x's dtype) -> (logits [M, E]
    in x's dtype, weights [M, K], expert ids [M, K] int64): `fused_route(decode_linear(x, w))`.
    blocks: (BLOCK_N, BLOCK_H, num_warps), as decode_linear's (None: ROUTER_BLOCKS)."""
    e, h = w.shape
    rows = check_decode_linear(x, w, None)
    weights, ids = route_outputs(rows, e, top_k, x.dtype, weights_fp32, x.device)
    logits = torch.empty((rows, e), dtype=x.dtype, device=x.device)
    if rows == 0:
        return logits, weights, ids
    p, block_n, block_h, warps = linear_blocks(rows, h, blocks)
    constants = route_constants(e, top_k, renormalize, weights)
    _router_kernel[(triton.cdiv(e, block_n),)](
        x.reshape(rows, h).contiguous(), w, logits, weights, ids, _counter(x.device), rows, e, h, top_k,
        ROWS=p, BLOCK_N=block_n, BLOCK_H=block_h, OUT_BF16_LOGITS=x.dtype == torch.bfloat16, **constants,
        num_warps=warps)
    return logits, weights, ids


def route_tokens(x: torch.Tensor, w: torch.Tensor, top_k: int, renormalize: bool, weights_fp32: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router on CUDA: `decode_router` for a decode step's few rows, the two launches it
    joins otherwise (prompts: cuBLAS logits; a strided weight)."""
    if x.numel() <= MAX_ROWS * x.shape[-1] and w.is_contiguous() and x.dtype == w.dtype:
        return decode_router(x, w, top_k, renormalize, weights_fp32)
    logits = linear(x, w)
    return (logits, *fused_route(logits, top_k, renormalize, weights_fp32))
