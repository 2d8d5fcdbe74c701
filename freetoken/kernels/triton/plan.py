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
    inside a CUDA graph: ~1 us a plan, plus ~0.4 us per fetched expert at S = 2273); one more
    such scan finds the first victim's last use (hybrid's horizon for recurring misses), and
    one reduction counts the free victims;
  - the split miss (hybrid; the twin's step 9) is the miss of rank F, the first unfetched: its
    routes stay -1, the GEMM's routes send them to the scratch slot S, and a [4] row says which
    expert and how many rows each side takes (the fill, GEMM and hand-off read it on the device);
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
from freetoken.reference.expert_cache import SPLIT_GRAIN as _SPLIT_GRAIN

SPLIT_GRAIN = tl.constexpr(_SPLIT_GRAIN)

FETCH_NONE, FETCH_ALL, FETCH_QSTAR, FETCH_QSTAR_RECURRING, FETCH_QSTAR_BACKGROUND = 0, 1, 2, 3, 4
FETCH_MODES = (FETCH_NONE, FETCH_ALL, FETCH_QSTAR, FETCH_QSTAR_RECURRING, FETCH_QSTAR_BACKGROUND)
POLICY_FETCH_MODE = {"resident": FETCH_ALL, "transfer": FETCH_ALL, "cpu": FETCH_NONE,
                     "static": FETCH_NONE, "hybrid": FETCH_QSTAR_RECURRING}
MAX_SLOTS = 1 << 14  # the slot keys live in registers; more slots would need a blocked scan


def fetch_mode(policy: str, fetch_recurring: bool = True, background: bool = False) -> int:
    """The plan kernel's mode for a policy; `fetch_recurring` and `background` are the twin's
    flags (hybrid only)."""
    mode = POLICY_FETCH_MODE[policy]
    if mode != FETCH_QSTAR_RECURRING:
        return mode
    if not fetch_recurring:
        return FETCH_QSTAR
    return FETCH_QSTAR_BACKGROUND if background else mode


@dataclass
class DevicePlan:
    routes: torch.Tensor  # [N, K] int32, slot id or -1 (route handed to the CPU)
    copy_slots: torch.Tensor  # [P] int32, slots to fill before the GEMM in plan order, then -1
    copy_fids: torch.Tensor  # [P] int32, the fid each fetched slot receives (either list), then -1
    background_slots: torch.Tensor  # [P] int32, -1 but at the plan's background fills (their slots)
    counts: torch.Tensor  # [4] int32: hits, misses, fetched (either list), background fills
    gemm_routes: torch.Tensor  # [N, K] int32, the slot GEMM's: routes, a split miss's at the scratch slot
    split: torch.Tensor  # [4] int32: scratch slot (-1: no split), fid, CPU rows c, GPU rows I - c


# the plan kernel's scalars that change from call to call (one compilation serves them all)
_RUNTIME_SCALARS = ["base", "num_ids", "num_slots", "fetch_mode", "ratio_q16", "split_units", "bell_value", "always"]


@triton.jit(do_not_specialize=_RUNTIME_SCALARS)
def _plan_kernel(
    ids_ptr, slot_of_ptr, fid_of_slot_ptr, last_used_ptr, last_active_ptr, step_ptr,
    routes_ptr, copy_slots_ptr, copy_fids_ptr, background_slots_ptr, counts_ptr, tally_ptr, gemm_routes_ptr, split_ptr,
    base, num_ids, num_slots, fetch_mode, ratio_q16, split_units,
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
    r = ratio_q16.to(tl.int64)
    lo = (m * r) >> 16
    cost_lo = tl.maximum(lo * (65536 - r), (m - lo) * r)
    cost_hi = tl.maximum((lo + 1) * (65536 - r), (m - lo - 1) * r)
    qstar_only = tl.minimum(m, tl.where(cost_lo <= cost_hi, lo, lo + 1))
    keep = tl.maximum(n_recurring, tl.minimum(n_miss, n_free)).to(tl.int64)  # R, min(M, Z)
    with_keep = (fetch_mode >= 3) & (r > 0)
    qstar = tl.where(with_keep, tl.maximum(qstar_only, keep), qstar_only)
    background = with_keep & (fetch_mode == 4)
    # Background fills where q* fetches nothing: the link is idle, every miss is fetched.
    qstar = tl.where(background & (qstar_only == 0), m, qstar)
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

    # The split miss (the twin's step 9): the first unfetched one, where the layer waits for lo.
    gpu_units = (((m * r) & 65535) * split_units + 32768) >> 16
    splits = ((fetch_mode >= 2) & (r > 0) & (split_units > 0) & (n_fetch < n_miss) & (n_wait.to(tl.int64) == lo)
              & (gpu_units > 0) & (gpu_units < split_units))
    split_fid = tl.sum(tl.where(pos == n_fetch, fid_of_rank, 0), axis=0)
    split_route = valid & splits & (fid == split_fid)
    cpu_rows = ((split_units - gpu_units) * SPLIT_GRAIN).to(tl.int32)
    d = tl.arange(0, 4)
    split = tl.where(d == 0, num_slots, tl.where(d == 1, split_fid, tl.where(d == 2, cpu_rows,
                                                                             gpu_units.to(tl.int32) * SPLIT_GRAIN)))
    tl.store(split_ptr + d, tl.where(splits, split, -1))

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
    tl.store(gemm_routes_ptr + pos, tl.where(split_route, num_slots, new_slot), mask=valid)
    tl.store(copy_slots_ptr + pos, tl.where(pos < n_wait, victim, -1), mask=valid)
    tl.store(copy_fids_ptr + pos, tl.where(fetched, fid_of_rank, -1), mask=valid)
    tl.store(background_slots_ptr + pos, tl.where(fetched & (pos >= n_wait), victim, -1), mask=valid)
    c = tl.arange(0, 4)
    counts = tl.where(c == 0, n_hits, tl.where(c == 1, n_miss, tl.where(c == 2, n_fetch, n_fetch - n_wait)))
    tl.store(counts_ptr + c, counts)
    if TALLY:  # the layer's counter row (tally_plan's sums), in this launch instead of its own
        tl.store(tally_ptr + c, tl.load(tally_ptr + c) + counts.to(tl.int64))
        cpu_routes = tl.sum((valid & (new_slot < 0)).to(tl.int64), axis=0)
        tl.store(tally_ptr + 4, tl.load(tally_ptr + 4) + cpu_routes)
        tl.store(tally_ptr + 5, tl.load(tally_ptr + 5) + num_ids)
        tl.store(tally_ptr + 6, tl.load(tally_ptr + 6) + tl.where(splits, gpu_units * SPLIT_GRAIN, 0))
    tl.store(step_ptr, step)
    if POST:  # the layer's CPU hand-off, reading back the routes and fill lists just stored
        tl.debug_barrier()  # (a block barrier: every thread's stores above are seen by all)
        _ring_post(x_ptr, w_ptr, ids_ptr, routes_ptr, mx_ptr, mw_ptr, mf_ptr, background_slots_ptr, copy_fids_ptr,
                   ms_ptr, mc_ptr, split_ptr, N, H, K, base, bell_ptr, bell_value, always, tickets_ptr, num_slots,
                   copy_slots_ptr, landed_ptr, counts_ptr, BLOCK_H, BLOCK_K, BLOCK_P, FILLS, TICKETS, False, FENCE)


def plan_layer_device(
    state: DeviceCacheState,
    layer: int,
    ids: torch.Tensor,
    fetch_mode: int,
    ratio_q16: int = 0,
    num_experts: int | None = None,
    tally: torch.Tensor | None = None,
    handoff: PlanHandoff | None = None,
    split_units: int = 0,
) -> DevicePlan:
    """Plan one MoE layer on the device; mutates `state` as `plan_layer` mutates its CacheState.

    ids [N, K] integer expert indices within the layer (on the state's device).
    fetch_mode: FETCH_NONE (cpu/static), FETCH_ALL (resident/transfer), FETCH_QSTAR_RECURRING
    (hybrid), FETCH_QSTAR_BACKGROUND (hybrid with background fills), FETCH_QSTAR (hybrid by q*
    alone); see `fetch_mode`. ratio_q16 in 0..65536 (used by
    the q* modes only).
    split_units: the twin's (an expert's rows in SPLIT_GRAIN units; 0: no split misses). A split
    miss's GPU rows come from the scratch slot, index S: the slot banks need S + 1 rows.
    tally: a layer's counter row [7] int64 (see `tally_plan`) the plan adds itself to, in the same
    launch; None leaves it to `tally_plan` (a post kernel that reroutes changes the routes after).
    handoff: the layer's fused CPU hand-off (`post_cpu_work` with a bell), run by the same
    program once the plan is stored: one launch where a captured layer took two.
    No host synchronisation: safe inside CUDA graph capture (outputs are fresh allocations).
    """
    if num_experts is not None and num_experts != state.num_experts:
        raise ValueError(f"num_experts {num_experts} != the state's {state.num_experts}")
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64) or ids.device != state.device:
        got = f"{ids.dtype}{tuple(ids.shape)} on {ids.device}"
        raise ValueError(f"ids must be [N, K] int32/int64 on {state.device}; got {got}")
    if fetch_mode not in FETCH_MODES or not 0 <= ratio_q16 <= 65536:
        raise ValueError(f"bad fetch_mode {fetch_mode} or ratio_q16 {ratio_q16}")
    if not 0 <= layer < state.num_layers:
        raise ValueError(f"layer {layer} out of range 0..{state.num_layers - 1}")
    if tally is not None and (tally.shape != (7,) or tally.dtype != torch.int64 or tally.device != state.device):
        raise ValueError(f"tally must be [7] int64 on {state.device}; got {tally.dtype}{tuple(tally.shape)}")
    if split_units < 0:
        raise ValueError(f"split_units must be >= 0, got {split_units}")
    if state.num_slots > MAX_SLOTS:
        raise ValueError(f"{state.num_slots} slots: the plan kernel handles at most {MAX_SLOTS}")
    n, k = ids.shape
    p = n * k
    out = torch.empty(5 * p + 8, dtype=torch.int32, device=state.device)  # one allocation, seven views
    routes, copy_slots, copy_fids = out[:p].view(n, k), out[p : 2 * p], out[2 * p : 3 * p]
    background_slots, gemm_routes = out[3 * p : 4 * p], out[4 * p : 5 * p].view(n, k)
    counts, split = out[5 * p : 5 * p + 4], out[5 * p + 4 :]
    block_s = max(16, triton.next_power_of_2(state.num_slots))
    post = handoff.kernel_args(n, k, state.num_slots) if handoff is not None else PlanHandoff.absent(counts)
    _plan_kernel[(1,)](
        ids.contiguous(), state.slot_of, state.fid_of_slot, state.last_used, state.last_active, state.step,
        routes, copy_slots, copy_fids, background_slots, counts, counts if tally is None else tally, gemm_routes, split,
        layer * state.num_experts, p, state.num_slots, fetch_mode, ratio_q16, split_units, *post.args,
        BLOCK_P=max(16, triton.next_power_of_2(p)), BLOCK_S=block_s, TALLY=tally is not None,
        POST=handoff is not None, **post.constants,
        num_warps=4 if block_s <= 2048 else 8 if block_s <= 8192 else 16, **pdl.launch(routes),
    )
    return DevicePlan(routes=routes, copy_slots=copy_slots, copy_fids=copy_fids,
                      background_slots=background_slots, counts=counts, gemm_routes=gemm_routes, split=split)


@triton.jit
def _tally_kernel(row_ptr, counts_ptr, routes_ptr, split_ptr, num_routes, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    c = tl.arange(0, 4)
    tl.store(row_ptr + c, tl.load(row_ptr + c) + tl.load(counts_ptr + c).to(tl.int64))
    p = tl.arange(0, BLOCK_P)
    routes = tl.load(routes_ptr + p, mask=p < num_routes, other=0)
    tl.store(row_ptr + 4, tl.load(row_ptr + 4) + tl.sum((routes < 0).to(tl.int64), axis=0))
    tl.store(row_ptr + 5, tl.load(row_ptr + 5) + num_routes)
    split_rows = tl.where(tl.load(split_ptr) >= 0, tl.load(split_ptr + 3), 0).to(tl.int64)
    tl.store(row_ptr + 6, tl.load(row_ptr + 6) + split_rows)


def tally_plan(row: torch.Tensor, plan: DevicePlan) -> None:
    """row [7] int64 (the slot cache's STAT_FIELDS: hits, misses, fetched, background, cpu_routes,
    routed, split_gpu_rows) += the plan's four counts, its CPU routes (-1), its routes and its
    split miss's GPU rows, in one launch: a captured layer's counters where the post kernel
    reroutes after the plan (elsewhere the plan kernel tallies itself: plan_layer_device's
    `tally`), where the torch expressions (`tally_plan_torch`, the twin) take several launches."""
    n = plan.routes.numel()
    _tally_kernel[(1,)](row, plan.counts, plan.routes, plan.split, n, BLOCK_P=max(16, triton.next_power_of_2(n)),
                        num_warps=1, **pdl.launch(row))


def tally_plan_torch(row: torch.Tensor, counts: torch.Tensor, routes: torch.Tensor, split: torch.Tensor) -> None:
    row[:4] += counts
    row[4] += (routes < 0).sum()
    row[5] += routes.numel()
    row[6] += torch.where(split[0] >= 0, split[3], 0)
