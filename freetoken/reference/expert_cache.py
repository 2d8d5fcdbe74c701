"""The expert cache's decisions, in plain Python: the specification every kernel must equal.

One GPU slot cache is shared by all MoE layers. Experts have flat ids `fid = layer * E + e`;
`-1` means absent everywhere. State (all ints):
    slot_of[L*E]      slot holding fid, or -1
    fid_of_slot[S]    fid held by a slot, or -1 (empty)
    last_used[S]      the step at which the slot was last used (hit or filled); 0 = never
    last_active[L*E]  the step at which the expert was last routed (hit or miss); 0 = never
    step              a counter bumped once per plan (one plan = one MoE layer of one forward)

One plan, for layer l and routed ids [N, K] (expert indices within the layer):
 1. step += 1. U = the distinct routed fids, ascending.
 2. Hits (slot_of[fid] >= 0) refresh last_used[slot] = step.
 3. Misses M = U minus hits. The policy's fetch rule (reference/fetch_rule.py) fixes how many to
    fetch, F: ALL (resident, transfer): F = |M|;  NONE (cpu, static): F = 0;  QSTAR: F = q*(|M|, r);
    QSTAR_RECURRING and QSTAR_BACKGROUND (hybrid): F = max(q*(|M|, r), R, min(|M|, Z)).
    q*: with r = B_pcie / (B_pcie + B_cpu) in Q16 fixed point (0..65536), fetching F of M costs
    max(F * (65536 - r), (M - F) * r) (the slower of the two branches, in common units);
    lo = (M * r) >> 16, and F is lo or lo + 1, whichever costs less (lo on a tie), at most M.
    R, the recurring misses (hybrid, r > 0): misses routed (last_active > 0) more recently than
    the least recently used victim slot (step 5) was used, which plain LRU (`transfer`) would
    still hold. q* prices one step; a fetched expert also serves every later step that routes
    it, a CPU-computed one serves none. Without R a lone miss (q*(1) = 0 for r < 1/2) would run
    on the CPU at every token, however often it recurs, and the cache would never learn it;
    with R the cache keeps what LRU keeps, while first-seen misses and those the cache's
    horizon has passed are still split by q*. When misses outrun the cache (realistic routing
    in a cache well short of the pool) the horizon is short and R rarely exceeds q*; when routing settles
    (greedy decoding's loops) it is long and hybrid converges to `transfer`'s hits.
    Z, the free victims (hybrid, r > 0, with R): victim slots (step 5) holding no expert. A
    miss put there evicts nothing, and plain LRU holds every expert while slots are free, so
    first-seen misses fill them too: a cold cache (a fresh server, the start of a benchmark)
    learns the working set at `transfer`'s pace instead of running it on the CPU.
    Background fills (hybrid with R and Z, `background`): q* alone decides how many misses
    this layer waits for; the ones R or Z add beyond it are still fetched, but in the
    background: this step computes them on the CPU (their routes stay -1) and only later
    steps read their slots. Nothing else is fetched in the background: q* balances the
    layer's two branches, so the link's idle time in a layer, (M - q*) * r - q* * (65536 - r)
    in cost units, is under one expert's fill, 65536 - r (q* + 1 would otherwise cost less; at
    a tie, exactly one): a further fill does not end before the layer does and delays the next
    layers' fills. (A rule that fetched every miss where q* fetches nothing put, below r = 1/3,
    each layer's misses on the link as well as on the CPU: docs/lab/reliability.md.)
 4. Which misses: most recently active first (last_active descending, then fid ascending), so
    the recurring ones come first.
 5. Victims: slots not used by this step (last_used < step), least recently used first
    (last_used ascending, then slot ascending). F is capped at the number of such slots.
 6. Each fetched fid takes the next victim: the victim's old fid (if any) loses its slot;
    slot_of / fid_of_slot / last_used[slot] = step are updated; the copy plan gets (slot, fid):
    the first q* of them in `copies` (filled before this layer's GEMM), the rest in
    `background` (background fills only; empty otherwise).
 7. last_active[fid] = step for every fid in U.
 8. Routes: each routed id becomes its slot, or -1 (computed on the CPU from the host pool):
    -1 too for the fids in `background`, whose slots are not filled yet.

The plan is a pure function of (state, ids, fetch rule, r): a cache of any size gives the same
model output, only the split between GPU slots and CPU routes changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from freetoken.reference.fetch_rule import FetchRule

Q16 = 1 << 16


def qstar(misses: int, ratio_q16: int) -> int:
    """How many of `misses` to fetch over PCIe, the rest going to the CPU."""
    if misses <= 0:
        return 0
    lo = (misses * ratio_q16) >> 16

    def cost(f: int) -> int:
        return max(f * (Q16 - ratio_q16), (misses - f) * ratio_q16)

    return min(misses, lo if cost(lo) <= cost(lo + 1) else lo + 1)


def pcie_share(pcie_bytes_per_s: float, cpu_bytes_per_s: float) -> float:
    """r = B_pcie / (B_pcie + B_cpu): the fetched share at which both branches finish together."""
    total = pcie_bytes_per_s + cpu_bytes_per_s
    if total <= 0:
        raise ValueError("bandwidths must be positive")
    return pcie_bytes_per_s / total


def share_q16(share: float) -> int:
    """A share r in [0, 1] in the plan's Q16 fixed point."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the hybrid split's PCIe share must be in [0, 1], got {share}")
    return round(share * Q16)


@dataclass
class CacheState:
    num_layers: int
    num_experts: int
    num_slots: int
    slot_of: list[int] = field(default_factory=list)
    fid_of_slot: list[int] = field(default_factory=list)
    last_used: list[int] = field(default_factory=list)
    last_active: list[int] = field(default_factory=list)
    step: int = 0

    def __post_init__(self) -> None:
        if not self.slot_of:
            self.slot_of = [-1] * (self.num_layers * self.num_experts)
            self.fid_of_slot = [-1] * self.num_slots
            self.last_used = [0] * self.num_slots
            self.last_active = [0] * (self.num_layers * self.num_experts)

    def place(self, fid: int, slot: int) -> None:
        """Put fid in slot outside any plan (initial placement for `resident` and `static`)."""
        old = self.fid_of_slot[slot]
        if old >= 0:
            self.slot_of[old] = -1
        if self.slot_of[fid] >= 0:
            self.fid_of_slot[self.slot_of[fid]] = -1
        self.slot_of[fid] = slot
        self.fid_of_slot[slot] = fid

    def check(self) -> None:
        """The two maps are inverse of each other."""
        for slot, fid in enumerate(self.fid_of_slot):
            assert fid == -1 or self.slot_of[fid] == slot, (slot, fid)
        for fid, slot in enumerate(self.slot_of):
            assert slot == -1 or self.fid_of_slot[slot] == fid, (fid, slot)


@dataclass
class Plan:
    routes: list[list[int]]  # [N][K] slot ids, -1 = CPU
    copies: list[tuple[int, int]]  # (slot, fid) to fill from the host pool before the GEMM, in order
    hits: int
    misses: int
    fetched: int  # len(copies) + len(background): experts moved over PCIe
    background: list[tuple[int, int]] = field(default_factory=list)  # (slot, fid) filled for later steps

    @property
    def on_cpu(self) -> int:
        """Distinct experts this step computes on the CPU (the misses it does not wait for)."""
        return self.misses - len(self.copies)


def plan_layer(state: CacheState, layer: int, ids: list[list[int]], rule: FetchRule, ratio_q16: int = 0) -> Plan:
    """Plan one MoE layer; mutates `state` as the kernels do. `rule` is the policy's (step 3):
    QSTAR_RECURRING adds R and Z, QSTAR_BACKGROUND makes the fetches they add background fills."""
    rule = FetchRule(rule)
    state.step += 1
    step = state.step
    base = layer * state.num_experts
    routed = sorted({base + e for row in ids for e in row})
    misses = []
    hits = 0
    for fid in routed:
        slot = state.slot_of[fid]
        if slot >= 0:
            state.last_used[slot] = step
            hits += 1
        else:
            misses.append(fid)
    victims = sorted((s for s in range(state.num_slots) if state.last_used[s] < step),
                     key=lambda s: (state.last_used[s], s))
    horizon = state.last_used[victims[0]] if victims else step  # the LRU victim's last use
    recurring = sum(1 for f in misses if state.last_active[f] > horizon)
    free = sum(1 for s in victims if state.fid_of_slot[s] < 0)
    if rule is FetchRule.ALL:
        want = len(misses)
    elif rule is FetchRule.NONE:
        want = 0
    else:
        want = qstar(len(misses), ratio_q16)
        if rule >= FetchRule.QSTAR_RECURRING and ratio_q16 > 0:
            want = max(want, recurring, min(len(misses), free))
    waited = want
    if rule is FetchRule.QSTAR_BACKGROUND and ratio_q16 > 0:
        waited = qstar(len(misses), ratio_q16)
    order = sorted(misses, key=lambda f: (-state.last_active[f], f))  # (step 4; read before step 7 writes)
    fetch = order[: min(want, len(victims))]
    copies = []
    for fid, slot in zip(fetch, victims, strict=False):
        old = state.fid_of_slot[slot]
        if old >= 0:
            state.slot_of[old] = -1
        state.slot_of[fid] = slot
        state.fid_of_slot[slot] = fid
        state.last_used[slot] = step
        copies.append((slot, fid))
    for fid in routed:
        state.last_active[fid] = step
    copies, later = copies[:waited], copies[waited:]
    unfilled = {fid for _, fid in later}
    routes = [[-1 if base + e in unfilled else state.slot_of[base + e] for e in row] for row in ids]
    return Plan(routes=routes, copies=copies, hits=hits, misses=len(misses), fetched=len(copies) + len(later),
                background=later)


def check_claim(num_experts: int, first_slot: int, keep_from: int) -> None:
    if keep_from < first_slot + num_experts:
        raise ValueError(f"kept experts must lie past the claimed slots {first_slot}..{first_slot + num_experts - 1}, "
                         f"got keep_from={keep_from}")


def claim_layer(state: CacheState, layer: int, first_slot: int, keep_from: int) -> None:
    """Prefill streaming has put every expert of `layer` in slots first_slot.. first_slot+E-1, in
    order (cache/prefill_stream.py). The experts the layer had cached at slots >= keep_from (past
    the streaming buffers) stay there: the stream copied them from there, and a prefill must not
    empty the decode cache. The rest now live in their buffer slots; a kept expert's buffer slot
    holds nothing (last_used 0: the first victim), and what the buffer held before loses its slot.
    Every expert of the layer counts as used now (one step, like a plan)."""
    E = state.num_experts
    check_claim(E, first_slot, keep_from)
    state.step += 1
    for e in range(E):
        fid, slot = layer * E + e, first_slot + e
        home = state.slot_of[fid]
        if home >= keep_from:
            old = state.fid_of_slot[slot]
            if old >= 0:
                state.slot_of[old] = -1
            state.fid_of_slot[slot] = -1
            state.last_used[slot] = 0
            state.last_used[home] = state.step
        else:
            state.place(fid, slot)
            state.last_used[slot] = state.step
