"""SwiGLU experts on the CPU, straight from the bf16 host banks (Numba).

Shape legend: N tokens, K top-k, H hidden, I expert intermediate, F flat expert ids (L*E),
P routed (token, k) pairs, U distinct experts among them.

    x [N, H] fp32, weights [N, K] fp32, ids [N, K] (fid, -1 = not for this executor)
    w13 [F, 2I, H] bf16 bits (gate rows, then up rows), w2 [F, H, I] bf16 bits
    out [N, H] fp32 = sum_k weights[n, k] * w2[f] @ (silu(w13[f, :I] @ x[n]) * (w13[f, I:] @ x[n]))

A route is a whole expert: every id is a fid in [0, F) or -1.

At decode batch sizes the kernel is a stream over expert bytes (9.4 MB per qwen3-30b-a3b
expert, one FMA per byte pair), so its shape serves memory, not arithmetic:
  - each distinct expert is read once however many tokens route to it (pairs grouped by id);
  - phase 1 (gate/up) splits (expert, block of I) over threads; every weight row is one
    contiguous H-long dot product, computed for all of that expert's tokens while the rows
    sit in L1;
  - phase 2 (down) splits H into row blocks over threads; a thread owns out[:, block] and
    adds the experts in ascending fid order, so there are no write races and the summation
    order matches the reference's;
  - inner loops run over contiguous memory with fp32 accumulators, several rows per pass
    (gate_rows / down_rows) so the widened x is loaded once per pass and each core keeps
    several streams in flight; `prefetch` adds software prefetches that many passes ahead
    (the same columns `prefetch * rows` rows further on), issued by an expert's first token.

fastmath allows reassociation (the vectorised reductions need it) but not nnan/ninf, so a NaN
or inf in the activations still comes out as one. Against the fp32 twin
(`freetoken.reference.moe.moe_experts` on widened banks) the result agrees to
max|out - twin| <= 1e-5 * max|twin| (summation order differs, nothing else).

Caching: only the entry points Python calls (`cpu_moe_tuned`) keep compiled code on disk, and
they call only uncached compiled functions, which Numba compiles into the caller's own cache
entry. A cached function called from another cached one loads the callee's entry separately,
and when a different process wrote the two the caller can jump into code that is not there
(numba/numba#8578: a segmentation fault at the first call of the second process to start).
`tests/test_numba_cache.py` holds every module here to that rule and runs every cached function
from two fresh processes in turn.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

# Every fastmath flag except nnan/ninf (see the module docstring).
FASTMATH = {"reassoc", "contract", "nsz", "arcp", "afn"}
BLOCK_I = 16  # intermediate indices per phase-1 work item (2 * 16 rows of H)
BLOCK_H = 16  # rows of w2 per phase-2 work item
_PF_BLOCK = 256  # elements per prefetch block: 512 bytes of bf16, eight cache lines per row
# The loop shape `cpu_moe` uses (see `cpu_moe_tuned`); benchmarks/cpu_experts_probe.py compares
# the blockings (its results in benchmarks/results/): several rows a pass with one pass of
# prefetch kept the kernel at the host's read bandwidth, where one row a pass fell short of it.
GATE_ROWS = 4
DOWN_ROWS = 8
PREFETCH = 1


@intrinsic
def _prefetch(typingctx, arr, idx):
    """Prefetch the cache line holding arr.data[idx] (no bounds check; a prefetch never faults)."""

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        off = context.cast(builder, args[1], sig.args[1], types.intp)
        ptr = builder.gep(ary.data, [off])
        i32 = ir.IntType(32)
        if getattr(ptr.type, "is_opaque", False):
            name = "llvm.prefetch.p0"
        else:  # typed-pointer LLVM
            ptr = builder.bitcast(ptr, ir.IntType(8).as_pointer())
            name = "llvm.prefetch.p0i8"
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32]), name
        )
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])  # read, keep in all levels, data
        return context.get_dummy_value()

    return types.none(arr, idx), codegen


@njit(fastmath=FASTMATH, inline="always")
def _bf16(w):
    return np.uint32(np.uint32(w) << np.uint32(16)).view(np.float32)


@njit(fastmath=FASTMATH, inline="always")
def _silu_mul(g, u):
    return g / (np.float32(1.0) + np.exp(-g)) * u


# Dot products of 2, 4 or 8 bf16 rows with one fp32 vector over [lo, hi). Fixed row counts keep
# every accumulator in a register; the k loop vectorises (widen, FMA) under reassociation.
@njit(fastmath=FASTMATH, inline="always")
def _acc2(s0, s1, r0, r1, x, lo, hi):
    for k in range(lo, hi):
        xk = x[k]
        s0 += _bf16(r0[k]) * xk
        s1 += _bf16(r1[k]) * xk
    return s0, s1


@njit(fastmath=FASTMATH, inline="always")
def _acc4(s0, s1, s2, s3, r0, r1, r2, r3, x, lo, hi):
    for k in range(lo, hi):
        xk = x[k]
        s0 += _bf16(r0[k]) * xk
        s1 += _bf16(r1[k]) * xk
        s2 += _bf16(r2[k]) * xk
        s3 += _bf16(r3[k]) * xk
    return s0, s1, s2, s3


@njit(fastmath=FASTMATH, inline="always")
def _acc8(s, r0, r1, r2, r3, r4, r5, r6, r7, x, lo, hi):
    s0, s1, s2, s3, s4, s5, s6, s7 = s
    for k in range(lo, hi):
        xk = x[k]
        s0 += _bf16(r0[k]) * xk
        s1 += _bf16(r1[k]) * xk
        s2 += _bf16(r2[k]) * xk
        s3 += _bf16(r3[k]) * xk
        s4 += _bf16(r4[k]) * xk
        s5 += _bf16(r5[k]) * xk
        s6 += _bf16(r6[k]) * xk
        s7 += _bf16(r7[k]) * xk
    return s0, s1, s2, s3, s4, s5, s6, s7


@njit(fastmath=FASTMATH)
def _dot2(r0, r1, x, pf):
    z = np.float32(0.0)
    n = x.shape[0]
    if pf <= 0:
        return _acc2(z, z, r0, r1, x, 0, n)
    s0, s1, k = z, z, 0
    while k + _PF_BLOCK <= n:
        for r in (r0, r1):
            for line in range(0, _PF_BLOCK, 32):
                _prefetch(r, k + pf + line)
        s0, s1 = _acc2(s0, s1, r0, r1, x, k, k + _PF_BLOCK)
        k += _PF_BLOCK
    return _acc2(s0, s1, r0, r1, x, k, n)


@njit(fastmath=FASTMATH)
def _dot4(r0, r1, r2, r3, x, pf):
    z = np.float32(0.0)
    n = x.shape[0]
    if pf <= 0:
        return _acc4(z, z, z, z, r0, r1, r2, r3, x, 0, n)
    s0, s1, s2, s3, k = z, z, z, z, 0
    while k + _PF_BLOCK <= n:
        for r in (r0, r1, r2, r3):
            for line in range(0, _PF_BLOCK, 32):
                _prefetch(r, k + pf + line)
        s0, s1, s2, s3 = _acc4(s0, s1, s2, s3, r0, r1, r2, r3, x, k, k + _PF_BLOCK)
        k += _PF_BLOCK
    return _acc4(s0, s1, s2, s3, r0, r1, r2, r3, x, k, n)


@njit(fastmath=FASTMATH)
def _dot8(r0, r1, r2, r3, r4, r5, r6, r7, x, pf):
    z = np.float32(0.0)
    n = x.shape[0]
    s = (z, z, z, z, z, z, z, z)
    if pf <= 0:
        return _acc8(s, r0, r1, r2, r3, r4, r5, r6, r7, x, 0, n)
    k = 0
    while k + _PF_BLOCK <= n:
        for r in (r0, r1, r2, r3, r4, r5, r6, r7):
            for line in range(0, _PF_BLOCK, 32):
                _prefetch(r, k + pf + line)
        s = _acc8(s, r0, r1, r2, r3, r4, r5, r6, r7, x, k, k + _PF_BLOCK)
        k += _PF_BLOCK
    return _acc8(s, r0, r1, r2, r3, r4, r5, r6, r7, x, k, n)


@njit(fastmath=FASTMATH)
def _gate_up(w, I, i, step, xv, act, pf):
    """act[i:i+step] = silu(gate rows) * up rows, for one token; w = w13[f] [2I, H]."""
    if step == 4:
        u = I + i
        s = _dot8(w[i], w[i + 1], w[i + 2], w[i + 3], w[u], w[u + 1], w[u + 2], w[u + 3], xv, pf)
        for j in range(4):
            act[i + j] = _silu_mul(s[j], s[4 + j])
    elif step == 2:
        s = _dot4(w[i], w[i + 1], w[I + i], w[I + i + 1], xv, pf)
        act[i] = _silu_mul(s[0], s[2])
        act[i + 1] = _silu_mul(s[1], s[3])
    else:
        s = _dot2(w[i], w[I + i], xv, pf)
        act[i] = _silu_mul(s[0], s[1])


@njit(fastmath=FASTMATH)
def _down(w, h, step, a, wt, o, pf):
    """o[h:h+step] += wt * (w[h:h+step] @ a), for one pair; w = w2[f] [H, I], a [I] its activations."""
    if step == 8:
        s = _dot8(w[h], w[h + 1], w[h + 2], w[h + 3], w[h + 4], w[h + 5], w[h + 6], w[h + 7], a, pf)
        for j in range(8):
            o[h + j] += wt * s[j]
    elif step == 4:
        s = _dot4(w[h], w[h + 1], w[h + 2], w[h + 3], a, pf)
        for j in range(4):
            o[h + j] += wt * s[j]
    else:  # two rows, or a last single row paired with itself
        s = _dot2(w[h], w[h + step - 1], a, pf)
        for j in range(step):
            o[h + j] += wt * s[j]


@njit(inline="always")
def _step(rows, left):
    """The largest of rows, 4, 2, 1 that fits in `left` (rows is 1, 2, 4 or 8)."""
    s = rows
    while s > left:
        s //= 2
    return s


ID_RANGE_ERROR = "expert id out of range: every id must be -1 or a fid below w13.shape[0]"


@njit(nogil=True)
def ids_in_range(ids, F):
    """True when every id is -1 or a fid below F."""
    N, K = ids.shape
    for n in range(N):
        for k in range(K):
            v = np.int64(ids[n, k])
            if v != -1 and (v < 0 or v >= F):
                return False
    return True


@njit(nogil=True)
def group_pairs(weights, ids):
    """Routed pairs grouped by fid: (fids [U], starts [U+1], pair_n [P], pair_w [P]).

    Pairs are ordered by (fid, n, k): experts ascending, as the reference accumulates them.
    The ids must be in range (`ids_in_range`)."""
    N, K = ids.shape
    flat = np.empty(N * K, np.int64)
    P = 0
    for n in range(N):
        for k in range(K):
            v = np.int64(ids[n, k])
            if v >= 0:
                flat[P] = v * (N * K) + n * K + k  # one sortable key per pair
                P += 1
    keys = np.sort(flat[:P])
    fids = np.empty(P, np.int64)
    starts = np.zeros(P + 1, np.int64)
    pair_n = np.empty(P, np.int64)
    pair_w = np.empty(P, np.float32)
    U = 0
    last = np.int64(-1)
    for p in range(P):
        e, nk = divmod(keys[p], N * K)
        n, k = divmod(nk, K)
        pair_n[p] = n
        pair_w[p] = weights[n, k]
        if U == 0 or last != e:
            fids[U] = e
            starts[U] = p
            last = e
            U += 1
    starts[U] = P
    return fids[:U], starts[: U + 1], pair_n, pair_w


@njit(fastmath=FASTMATH)
def gate_up_range(u, i0, i1, fids, starts, pair_n, x, w13, act, gate_rows, pf13):
    """act[p, i0:i1] for every pair p of distinct expert u (phase 1 over one range of I).

    i0 must be a multiple of gate_rows: every caller then splits I into the same passes, so
    any split of the work over threads gives the same bits."""
    w = w13[fids[u]]  # [2I, H]
    I = w.shape[0] // 2
    i = i0
    while i < i1:
        step = _step(gate_rows, i1 - i)
        for p in range(starts[u], starts[u + 1]):
            _gate_up(w, I, i, step, x[pair_n[p]], act[p], pf13 if p == starts[u] else 0)
        i += step


@njit(fastmath=FASTMATH)
def down_range(h0, h1, fids, starts, pair_n, pair_w, act, w2, out, down_rows, pf2):
    """out[:, h0:h1] = the experts' down projections over that range of H, added in ascending
    fid order (phase 2; h0 a multiple of down_rows, as for gate_up_range)."""
    out[:, h0:h1] = 0.0
    for u in range(fids.shape[0]):
        w = w2[fids[u]]  # [H, I]
        h = h0
        while h < h1:
            step = _step(down_rows, h1 - h)
            for p in range(starts[u], starts[u + 1]):
                _down(w, h, step, act[p], pair_w[p], out[pair_n[p]], pf2 if p == starts[u] else 0)
            h += step


@njit(parallel=True, nogil=True, fastmath=FASTMATH)
def _experts(x, fids, starts, pair_n, pair_w, w13, w2, out, gate_rows, down_rows, prefetch):
    """The two parallel phases over grouped pairs (no dependence on the ids' dtype, so one
    compilation serves int32 and int64 ids)."""
    H = x.shape[1]
    I = w2.shape[2]
    act = np.empty((pair_n.shape[0], I), np.float32)  # [P, I]
    pf13 = prefetch * gate_rows * H  # elements: the next pass's rows (rows are contiguous)
    pf2 = prefetch * down_rows * I

    # Phase-1 items: (expert, block of BLOCK_I intermediate indices), experts one after another.
    nb = (I + BLOCK_I - 1) // BLOCK_I
    for item in prange(fids.shape[0] * nb):
        it = np.int64(item)  # prange indices may be unsigned; keep index math signed
        u, b = divmod(it, nb)
        i = b * BLOCK_I
        gate_up_range(u, i, min(i + BLOCK_I, I), fids, starts, pair_n, x, w13, act, gate_rows, pf13)

    for blk in prange((H + BLOCK_H - 1) // BLOCK_H):
        h0 = np.int64(blk) * BLOCK_H
        down_range(h0, min(h0 + BLOCK_H, H), fids, starts, pair_n, pair_w, act, w2, out, down_rows, pf2)


@njit(nogil=True)
def experts_tuned(x, weights, ids, w13, w2, out, gate_rows, down_rows, prefetch):
    """`cpu_moe` with its loop shape chosen, for compiled callers (the pollers): gate_rows
    (1, 2, 4) intermediate indices per phase-1 pass (twice as many rows of w13), down_rows
    (2, 4, 8) rows of w2 per phase-2 pass, prefetch: software prefetch distance in passes
    (0 = hardware prefetch only).

    Work is split statically over the calling thread's Numba threads, unless that thread set
    `numba.set_parallel_chunksize` (it must be set outside: inside, Numba cannot cache)."""
    N, H = x.shape
    F, I2, H13 = w13.shape
    I = I2 // 2
    if (H13 != H or w2.shape[0] != F or w2.shape[1] != H or w2.shape[2] != I or I2 != 2 * I
            or ids.shape[0] != N or weights.shape != ids.shape or out.shape != x.shape):
        raise ValueError("shape mismatch: need x/out [N,H], weights/ids [N,K], w13 [F,2I,H], w2 [F,H,I]")
    if gate_rows not in (1, 2, 4) or down_rows not in (2, 4, 8):
        raise ValueError("gate_rows must be 1, 2 or 4 and down_rows 2, 4 or 8")
    if not ids_in_range(ids, F):
        raise ValueError(ID_RANGE_ERROR)
    fids, starts, pair_n, pair_w = group_pairs(weights, ids)
    if fids.shape[0] == 0:
        out[:] = 0.0
    else:
        _experts(x, fids, starts, pair_n, pair_w, w13, w2, out, gate_rows, down_rows, prefetch)


@njit(nogil=True, cache=True)
def cpu_moe_tuned(x, weights, ids, w13, w2, out, gate_rows, down_rows, prefetch):
    """`experts_tuned` as a cached entry point for Python callers (module docstring: Caching)."""
    experts_tuned(x, weights, ids, w13, w2, out, gate_rows, down_rows, prefetch)


def cpu_moe(x, weights, ids, w13, w2, out):
    """out[N, H] = the weighted SwiGLU experts of every routed id (see the module docstring).

    x fp32 [N, H], weights fp32 [N, K], ids int32/int64 [N, K] (fids, -1 = skip), w13 uint16
    [F, 2I, H], w2 uint16 [F, H, I], out fp32 [N, H] (overwritten). The compiled call releases
    the GIL.

    A Python call of the cached `cpu_moe_tuned` (module docstring: Caching)."""
    # np.int64: a bare int would type as a literal and compile a second specialisation
    cpu_moe_tuned(x, weights, ids, w13, w2, out, np.int64(GATE_ROWS), np.int64(DOWN_ROWS), np.int64(PREFETCH))


def cpu_moe_torch(
    x: np.ndarray, weights: np.ndarray, ids: np.ndarray, w13: np.ndarray, w2: np.ndarray, out: np.ndarray
) -> None:
    """The same contract through torch's bf16 CPU matmuls (oneDNN; AMX where present), for speed
    comparison. x and the SwiGLU activations are rounded to bf16, so agreement
    with the fp32 twin is only ~1e-2 of the output scale. Threads: torch.set_num_threads."""
    import torch
    import torch.nn.functional as F

    out[:] = 0.0
    if not ids_in_range(ids, w13.shape[0]):
        raise ValueError(ID_RANGE_ERROR)
    xt = torch.from_numpy(x).to(torch.bfloat16)  # [N, H]
    ot = torch.from_numpy(out)
    for f in np.unique(ids[ids >= 0]).tolist():  # fid ascending
        n_idx, k_idx = np.nonzero(ids == f)
        w_up = torch.from_numpy(w13[f].view(np.int16)).view(torch.bfloat16)  # [2I, H]
        w_dn = torch.from_numpy(w2[f].view(np.int16)).view(torch.bfloat16)  # [H, I]
        gate, up = F.linear(xt[n_idx], w_up).float().chunk(2, dim=-1)  # [n, I] each
        y = F.linear((F.silu(gate) * up).to(torch.bfloat16), w_dn).float()  # [n, H]
        ot.index_add_(0, torch.from_numpy(n_idx), y * torch.from_numpy(weights[n_idx, k_idx])[:, None])
