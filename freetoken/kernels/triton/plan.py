"""The plan kernel: one MoE layer's cache decisions on the device.

Shape legend: N tokens, K top-k, P = N*K routed ids, S slots, L layers, E experts per layer.
Twin (the specification, equal bit for bit): `freetoken.reference.expert_cache.plan_layer`.

One program does the whole plan, because every decision depends on all routed ids and on the
least recently used slots of the whole cache:
  - routed ids are compared pairwise ([P, P] in registers) to find the distinct ones and to
    rank the misses by (last_active desc, fid asc);
  - the victims are found by repeated minimum over the whole slot array held in registers,
    one key per slot `last_used * BLOCK_S + slot` (so ties fall to the lower slot; steps stay
    below 2**49), each round taking the smallest key above the previous one; this loops
    F (+ skipped hits) times and costs nothing when nothing is fetched (measured on an H200
    inside a CUDA graph); one more
    such scan finds the first victim's last use (hybrid's horizon for recurring misses), and
    one reduction counts the free victims;
  - every read happens before every write, so threads never need to see each other's stores.
The step counter lives on the device and is bumped here: the launcher never waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from freetoken.kernels.device_cache_state import DeviceCacheState
from freetoken.kernels.triton import pdl
from freetoken.kernels.triton.cpu_handoff import PlanHandoff, _ring_post
from freetoken.reference.fetch_rule import FetchRule

MAX_SLOTS = 1 << 14  # the slot keys live in registers; more slots would need a blocked scan


@dataclass
class DevicePlan:
    routes: torch.Tensor  # [N, K] int32, slot id or -1 (route handed to the CPU)
    copy_slots: torch.Tensor  # [P] int32, slots to fill before the GEMM in plan order, then -1
    copy_fids: torch.Tensor  # [P] int32, the fid each fetched slot receives (either list), then -1
    background_slots: torch.Tensor  # [P] int32, -1 but at the plan's background fills (their slots)
    counts: torch.Tensor  # [4] int32: hits, misses, fetched (either list), background fills


# the plan kernel's scalars that change from call to call (one compilation serves them all)
_RUNTIME_SCALARS = ["base", "num_ids", "num_slots", "fetch_mode", "bell_value", "always"]


@triton.jit(do_not_specialize=_RUNTIME_SCALARS)
def _plan_kernel(
    ids_ptr, slot_of_ptr, fid_of_slot_ptr, last_used_ptr, last_active_ptr, step_ptr,
    routes_ptr, copy_slots_ptr, copy_fids_ptr, background_slots_ptr, counts_ptr, tally_ptr,
    base, num_ids, num_slots, fetch_mode, ratio_ptr,
    # the fused hand-off after the plan (POST; see plan_layer_device's `handoff`)
    x_ptr, w_ptr, mx_ptr, mw_ptr, mf_ptr, ms_ptr, mc_ptr, N, H, K, bell_ptr, bell_value, always,
    tickets_ptr, landed_ptr,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, TALLY: tl.constexpr, POST: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, FILLS: tl.constexpr, TICKETS: tl.constexpr,
    FENCE: tl.constexpr, PDL: tl.constexpr,
):
    pdl.enter(PDL)
    INT64_MAX: tl.constexpr = 0x7FFFFFFFFFFFFFFF
    step = tl.load(step_ptr) + 1  # int64

    # Routed ids [BLOCK_P]; position i is the distinct representative if no earlier j has its fid.
    pos = tl.arange(0, BLOCK_P)
    valid = pos < num_ids
    fid = tl.load(ids_ptr + pos, mask=valid, other=0).to(tl.int32) + base
    dup_of_earlier = (fid[:, None] == fid[None, :]) & valid[None, :] & (pos[None, :] < pos[:, None])
    uniq = valid & (tl.sum(dup_of_earlier.to(tl.int32), axis=1) == 0)
    slot = tl.load(slot_of_ptr + fid, mask=valid, other=-1)  # int32
    hit = valid & (slot >= 0)
    uhit = uniq & hit
    umiss = uniq & ~hit
    n_hits = tl.sum(uhit.to(tl.int32), axis=0)
    n_miss = tl.sum(umiss.to(tl.int32), axis=0)

    # Rank of each routed miss among the distinct misses (duplicates share their fid's rank).
    la = tl.load(last_active_ptr + fid, mask=valid, other=0)
    la_j = la[None, :]
    la_i = la[:, None]
    ahead = (la_j > la_i) | ((la_j == la_i) & (fid[None, :] < fid[:, None]))
    rank = tl.sum((ahead & umiss[None, :]).to(tl.int32), axis=1)

    # Victim keys over all slots. Hit slots count as used by this step: they are not removed
    # from `key` (no scatter into registers) but skipped when the scans meet them.
    s = tl.arange(0, BLOCK_S)
    lu = tl.load(last_used_ptr + s, mask=s < num_slots, other=INT64_MAX)
    eligible = lu < step
    key = tl.where(eligible, lu * BLOCK_S + s, INT64_MAX)
    hit_lu = tl.load(last_used_ptr + slot, mask=uhit, other=INT64_MAX)
    n_victims = tl.sum(eligible.to(tl.int32), axis=0) - tl.sum((uhit & (hit_lu < step)).to(tl.int32), axis=0)
    hit_slot = tl.where(uhit, slot, -1)

    # The horizon: the first victim's last use (hit slots skipped; usually the first key).
    # Misses routed more recently are recurring: plain LRU would still hold them.
    first = step * 0 - 1
    searching = n_victims > 0
    while searching:
        first = tl.min(tl.where(key > first, key, INT64_MAX), axis=0)
        first_slot = (first & (BLOCK_S - 1)).to(tl.int32)
        searching = (tl.sum((hit_slot == first_slot).to(tl.int32), axis=0) > 0) & (first < INT64_MAX)
    horizon = tl.where((n_victims > 0) & (first < INT64_MAX), first // BLOCK_S, step)
    n_recurring = tl.sum((umiss & (la > horizon)).to(tl.int32), axis=0)
    # Free victims: eligible slots holding no expert (a hit slot always holds one).
    held = tl.load(fid_of_slot_ptr + s, mask=s < num_slots, other=0)
    n_free = tl.sum((eligible & (held < 0)).to(tl.int32), axis=0)

    # How many to fetch. q* in int64 exactly as the twin: M * r needs more than 32 bits.
    m = n_miss.to(tl.int64)
    r = tl.load(ratio_ptr).to(tl.int64)  # read at run time: a replayed graph follows a live split
    lo = (m * r) >> 16
    cost_lo = tl.maximum(lo * (65536 - r), (m - lo) * r)
    cost_hi = tl.maximum((lo + 1) * (65536 - r), (m - lo - 1) * r)
    qstar_only = tl.minimum(m, tl.where(cost_lo <= cost_hi, lo, lo + 1))
    keep = tl.maximum(n_recurring, tl.minimum(n_miss, n_free)).to(tl.int64)  # R, min(M, Z)
    with_keep = (fetch_mode >= 3) & (r > 0)
    qstar = tl.where(with_keep, tl.maximum(qstar_only, keep), qstar_only)
    background = with_keep & (fetch_mode == 4)
    want = tl.where(fetch_mode == 0, 0, tl.where(fetch_mode == 1, m, qstar))
    n_fetch = tl.minimum(want, n_victims.to(tl.int64)).to(tl.int32)
    # Background fills: the layer waits for the first q* fetches only.
    n_wait = tl.where(background, tl.minimum(qstar_only.to(tl.int32), n_fetch), n_fetch)

    # victim[t] = the slot given to the miss of rank t.
    victim = tl.full([BLOCK_P], -1, tl.int32)
    t = n_fetch * 0
    prev = step * 0 - 1
    while (t < n_fetch) & (prev < INT64_MAX):
        k = tl.min(tl.where(key > prev, key, INT64_MAX), axis=0)
        prev = k
        vs = (k & (BLOCK_S - 1)).to(tl.int32)
        take = (tl.sum((hit_slot == vs).to(tl.int32), axis=0) == 0) & (k < INT64_MAX)
        victim = tl.where((pos == t) & take, vs, victim)
        t += take.to(tl.int32)

    # The fetched fid of each rank, and each routed id's slot after the plan.
    fetched = pos < n_fetch  # by rank
    by_rank = (rank[None, :] == pos[:, None]) & umiss[None, :]  # [rank, position]
    fid_of_rank = tl.sum(tl.where(by_rank, fid[None, :], 0), axis=1)
    slot_of_rank = tl.sum(tl.where(pos[None, :] == rank[:, None], victim[None, :], 0), axis=1)
    new_slot = tl.where(hit, slot, tl.where(rank < n_wait, slot_of_rank, -1))
    old_fid = tl.load(fid_of_slot_ptr + victim, mask=fetched, other=-1)

    # Writes. Their addresses are disjoint (victims are distinct, not hit slots; evicted fids
    # are resident, fetched ones are not), so their order does not matter.
    tl.store(slot_of_ptr + old_fid, tl.full([BLOCK_P], -1, tl.int32), mask=fetched & (old_fid >= 0))
    tl.store(slot_of_ptr + fid_of_rank, victim, mask=fetched)
    tl.store(fid_of_slot_ptr + victim, fid_of_rank, mask=fetched)
    steps = tl.full([BLOCK_P], 0, tl.int64) + step
    tl.store(last_used_ptr + victim, steps, mask=fetched)
    tl.store(last_used_ptr + slot, steps, mask=uhit)
    tl.store(last_active_ptr + fid, steps, mask=uniq)
    tl.store(routes_ptr + pos, new_slot, mask=valid)
    tl.store(copy_slots_ptr + pos, tl.where(pos < n_wait, victim, -1), mask=valid)
    tl.store(copy_fids_ptr + pos, tl.where(fetched, fid_of_rank, -1), mask=valid)
    tl.store(background_slots_ptr + pos, tl.where(fetched & (pos >= n_wait), victim, -1), mask=valid)
    c = tl.arange(0, 4)
    counts = tl.where(c == 0, n_hits, tl.where(c == 1, n_miss, tl.where(c == 2, n_fetch, n_fetch - n_wait)))
    tl.store(counts_ptr + c, counts)
    if TALLY:  # the layer's counter row, in this launch instead of one of its own
        tl.store(tally_ptr + c, tl.load(tally_ptr + c) + counts.to(tl.int64))
        cpu_routes = tl.sum((valid & (new_slot < 0)).to(tl.int64), axis=0)
        tl.store(tally_ptr + 4, tl.load(tally_ptr + 4) + cpu_routes)
        tl.store(tally_ptr + 5, tl.load(tally_ptr + 5) + num_ids)
    tl.store(step_ptr, step)
    if POST:  # the layer's CPU hand-off, reading back the routes and fill lists just stored
        tl.debug_barrier()  # (a block barrier: every thread's stores above are seen by all)
        _ring_post(x_ptr, w_ptr, ids_ptr, routes_ptr, mx_ptr, mw_ptr, mf_ptr, background_slots_ptr, copy_fids_ptr,
                   ms_ptr, mc_ptr, N, H, K, base, bell_ptr, bell_value, always, tickets_ptr, num_slots,
                   copy_slots_ptr, landed_ptr, BLOCK_H, BLOCK_K, BLOCK_P, FILLS, TICKETS, FENCE)


def _ratio_tensor(ratio_q16: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The split as the kernel reads it: a [1] int32 tensor on `device` in 0..65536."""
    if isinstance(ratio_q16, torch.Tensor):
        if ratio_q16.shape != (1,) or ratio_q16.dtype != torch.int32 or ratio_q16.device != device:
            raise ValueError(f"ratio_q16 must be a [1] int32 tensor on {device}; got "
                             f"{ratio_q16.dtype}{tuple(ratio_q16.shape)} on {ratio_q16.device}")
        return ratio_q16  # (its value is checked where it is written: the kernel cannot wait for it)
    if not 0 <= ratio_q16 <= 65536:
        raise ValueError(f"bad ratio_q16 {ratio_q16}: the split's Q16 share is in 0..65536")
    return torch.full((1,), ratio_q16, dtype=torch.int32, device=device)


def plan_layer_device(
    state: DeviceCacheState,
    layer: int,
    ids: torch.Tensor,
    fetch_mode: int,
    ratio_q16: int | torch.Tensor = 0,
    num_experts: int | None = None,
    tally: torch.Tensor | None = None,
    handoff: PlanHandoff | None = None,
) -> DevicePlan:
    """Plan one MoE layer on the device; mutates `state` as `plan_layer` mutates its CacheState.

    ids [N, K] integer expert indices within the layer (on the state's device).
    fetch_mode: the policy's FetchRule (reference/fetch_rule.py). ratio_q16 in 0..65536 (used by
    the q* modes only): an int, or a [1] int32 tensor on the state's device that the kernel reads
    when it runs, so a captured graph plans with whatever split the host last wrote there (the
    live split, moe/live_split.py); an int is written to a fresh one (a fill kernel, capturable).
    tally: a layer's counter row [6] int64 (the slot cache's STAT_FIELDS: hits, misses, fetched,
    background, cpu_routes, routed) the plan adds its counts to, in the same launch; None: none.
    handoff: the layer's fused CPU hand-off (`post_cpu_work` with a bell), run by the same
    program once the plan is stored: one launch where a captured layer took two.
    No host synchronisation: safe inside CUDA graph capture (outputs are fresh allocations).
    """
    if num_experts is not None and num_experts != state.num_experts:
        raise ValueError(f"num_experts {num_experts} != the state's {state.num_experts}")
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64) or ids.device != state.device:
        got = f"{ids.dtype}{tuple(ids.shape)} on {ids.device}"
        raise ValueError(f"ids must be [N, K] int32/int64 on {state.device}; got {got}")
    if fetch_mode not in set(FetchRule):
        raise ValueError(f"bad fetch_mode {fetch_mode}")
    ratio = _ratio_tensor(ratio_q16, state.device)
    if not 0 <= layer < state.num_layers:
        raise ValueError(f"layer {layer} out of range 0..{state.num_layers - 1}")
    if tally is not None and (tally.shape != (6,) or tally.dtype != torch.int64 or tally.device != state.device):
        raise ValueError(f"tally must be [6] int64 on {state.device}; got {tally.dtype}{tuple(tally.shape)}")
    if state.num_slots > MAX_SLOTS:
        raise ValueError(f"{state.num_slots} slots: the plan kernel handles at most {MAX_SLOTS}")
    n, k = ids.shape
    p = n * k
    out = torch.empty(4 * p + 4, dtype=torch.int32, device=state.device)  # one allocation, five views
    routes, copy_slots, copy_fids = out[:p].view(n, k), out[p : 2 * p], out[2 * p : 3 * p]
    background_slots, counts = out[3 * p : 4 * p], out[4 * p :]
    block_s = max(16, triton.next_power_of_2(state.num_slots))
    post = handoff.kernel_args(n, k, state.num_slots) if handoff is not None else PlanHandoff.absent(counts)
    _plan_kernel[(1,)](
        ids.contiguous(), state.slot_of, state.fid_of_slot, state.last_used, state.last_active, state.step,
        routes, copy_slots, copy_fids, background_slots, counts, counts if tally is None else tally,
        layer * state.num_experts, p, state.num_slots, fetch_mode, ratio, *post.args,
        BLOCK_P=max(16, triton.next_power_of_2(p)), BLOCK_S=block_s, TALLY=tally is not None,
        POST=handoff is not None, **post.constants,
        num_warps=4 if block_s <= 2048 else 8 if block_s <= 8192 else 16, **pdl.launch(routes),
    )
    return DevicePlan(routes=routes, copy_slots=copy_slots, copy_fids=copy_fids,
                      background_slots=background_slots, counts=counts)
