"""The expert hierarchy's pairs: the plan (and its counters' tally), the slot GEMM, the slot fill and the bf16
rounding they share."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass

from freetoken.kernels.registry import BIT_EXACT, KernelSpec, Tolerance, register_kernel
from freetoken.kernels.specs.common import torch_dtype


@dataclass(frozen=True)
class PlanCase:
    """A cache of L*E experts and S slots, a starting state, and a sequence of plans."""

    num_layers: int
    num_experts: int
    num_slots: int
    placed: tuple[tuple[int, int], ...]  # (fid, slot) put in the cache before the first plan
    start_step: int  # the step counter before the first plan (last_* of placed fids lie below it)
    steps: tuple[tuple[int, tuple[tuple[int, ...], ...], str, int], ...]  # (layer, ids [N][K], policy, r)
    fetch_recurring: bool = True  # hybrid fetches recurring misses
    background: bool = False  # ... and those beyond q* are background fills
    tally: bool = False  # the kernel also adds each plan to a counter row (the captured layers' way)
    split_units: int = 0  # hybrid splits a miss by its rows (SPLIT_GRAIN-row units an expert has; 0: never)

    def initial_state(self):
        from freetoken.reference.expert_cache import CacheState

        state = CacheState(self.num_layers, self.num_experts, self.num_slots)
        for i, (fid, slot) in enumerate(self.placed):
            state.place(fid, slot)
            state.last_used[slot] = state.last_active[fid] = (i * 7919) % (self.start_step + 1)
        state.step = self.start_step
        return state


def _plan_strategy():
    from hypothesis import strategies as st

    from freetoken.reference.expert_cache import POLICIES

    @st.composite
    def cases(draw: Callable) -> PlanCase:
        L, E = draw(st.integers(1, 4)), draw(st.integers(2, 16))
        S = draw(st.integers(E, L * E))
        K = draw(st.integers(1, min(8, E)))
        max_n = draw(st.integers(1, 8))
        policies = draw(st.lists(st.sampled_from(POLICIES), min_size=1, max_size=3, unique=True))
        special = [0, 1, 21845, 32768, 65535, 65536]  # ends, thirds and halves (q* cost ties)
        ratio = draw(st.sampled_from(special) | st.integers(0, 65536))
        jitter = draw(st.booleans())  # a fresh ratio every plan (bandwidths refreshed live)
        hot, p_hot = draw(st.integers(1, E)), draw(st.sampled_from([0.0, 0.5, 0.9]))
        distinct = draw(st.booleans())  # top-k rows hold distinct experts; the plan must not care
        rng = random.Random(draw(st.integers(0, 2**32 - 1)))
        placed: tuple[tuple[int, int], ...] = ()
        if draw(st.booleans()):
            fids = rng.sample(range(L * E), rng.randint(0, S))
            placed = tuple(zip(fids, rng.sample(range(S), len(fids)), strict=True))
        hot_set = [rng.sample(range(E), hot) for _ in range(L)]
        steps = []
        for _ in range(draw(st.integers(64, 72))):
            layer = rng.randrange(L)
            rows = []
            for _ in range(rng.randint(1, max_n)):
                pool = hot_set[layer] if rng.random() < p_hot and hot >= K else range(E)
                rows.append(tuple(rng.sample(pool, K) if distinct else rng.choices(pool, k=K)))
            r = rng.choice([rng.randint(0, 65536), rng.choice(special)]) if jitter else ratio
            steps.append((layer, tuple(rows), rng.choice(policies), r))
        return PlanCase(L, E, S, placed, draw(st.sampled_from([0, 5, 1000])), tuple(steps), draw(st.booleans()),
                        draw(st.booleans()), draw(st.booleans()), draw(st.sampled_from([0, 2, 3, 24, 448])))

    return cases()


_TALLY_START = 2**40 + 7  # every counter of the row starts here: sums beyond 32 bits


def _plan_record(routes: list, copy_slots: list[int], copy_fids: list[int], background_slots: list[int],
                 counts: list[int], state, tally: list[int] | None, gemm_routes: list, split: list[int]) -> dict:
    # counts: hits, misses, fetched; the background fills' count apart (older cases read three)
    return {"routes": routes, "copy_slots": copy_slots, "copy_fids": copy_fids,
            "background_slots": background_slots, "counts": counts[:3], "background": counts[3],
            "state": asdict(state), "tally": tally, "gemm_routes": gemm_routes, "split": split}


def _plan_kernel(case: PlanCase, device: str) -> list[dict]:
    import torch

    from freetoken.cache.device_state import DeviceCacheState
    from freetoken.kernels.triton.plan import fetch_mode, plan_layer_device

    state = DeviceCacheState.from_reference(case.initial_state(), device)
    rows = torch.full((case.num_layers, 7), _TALLY_START, dtype=torch.int64, device=device)
    out = []
    for layer, ids, policy, ratio in case.steps:
        ids_t = torch.tensor(ids, device=device)  # [N, K]
        plan = plan_layer_device(state, layer, ids_t, fetch_mode(policy, case.fetch_recurring, case.background),
                                 ratio, tally=rows[layer] if case.tally else None, split_units=case.split_units)
        out.append(_plan_record(plan.routes.tolist(), plan.copy_slots.tolist(), plan.copy_fids.tolist(),
                                plan.background_slots.tolist(), plan.counts.tolist(), state.to_reference(),
                                rows[layer].tolist() if case.tally else None, plan.gemm_routes.tolist(),
                                plan.split.tolist()))
    return out


def _plan_twin(case: PlanCase) -> list[dict]:
    from freetoken.reference.expert_cache import SPLIT_GRAIN, plan_layer

    state = case.initial_state()
    rows = [[_TALLY_START] * 7 for _ in range(case.num_layers)]
    out = []
    for layer, ids, policy, ratio in case.steps:
        plan = plan_layer(state, layer, [list(row) for row in ids], policy, ratio, case.fetch_recurring,
                          case.background, case.split_units)
        # The kernel's plan has a fixed width and lists the waited-for copies, then the background ones.
        width = len(ids) * len(ids[0])
        fetched = plan.copies + plan.background
        waited = [s for s, _ in plan.copies]
        slots = waited + [-1] * (width - len(waited))
        background = [-1] * len(waited) + [s for s, _ in plan.background]
        background += [-1] * (width - len(background))
        fids = [f for _, f in fetched] + [-1] * (width - len(fetched))
        counts = [plan.hits, plan.misses, plan.fetched, len(plan.background)]
        cpu_routes = sum(route < 0 for row in plan.routes for route in row)
        inter = case.split_units * SPLIT_GRAIN
        split = list(plan.split_row(case.num_slots, inter))
        rows[layer] = [a + b for a, b in zip(rows[layer], [*counts, cpu_routes, width, max(split[3], 0)],
                                             strict=True)]
        out.append(_plan_record(plan.routes, slots, fids, background, counts, state,
                                list(rows[layer]) if case.tally else None, plan.gemm_routes, split))
    return out


register_kernel(KernelSpec(
    name="plan", strategy=_plan_strategy, kernel=_plan_kernel, twin=_plan_twin, guarantee=BIT_EXACT,
    max_examples=12,
    doc="kernels/triton/plan.py vs reference/expert_cache.py: outputs, state and (drawn) the counter row, every step",
))


@dataclass(frozen=True)
class GemmCase:
    """Shapes and a seed; `tensors()` draws x, weights, routes (-1 included) and the slot banks."""

    n: int
    k: int
    hidden: int
    inter: int
    slots: int
    x_dtype: str
    w_dtype: str
    scale: float
    small_blocks: bool  # tiles smaller than the problem, so that the kernels' loops and masks run
    seed: int
    split_first: int = -1  # >= 0: slot 0 is a split miss's, its routes computing rows [split_first, I) only
    landing: bool = False  # pass a fill list (every other route's slot): the act kernel's early path

    def landing_slots(self, routes):
        """A plan's copy_slots for the drawn routes: every other route's slot, then -1 padding."""
        flat = routes.flatten().clone()
        flat[1::2] = -1
        return flat if self.landing else None

    def split(self):
        import torch

        if self.split_first < 0 or self.split_first >= self.inter:
            return None
        return torch.tensor([0, 5, self.split_first, self.inter - self.split_first], dtype=torch.int32)

    def tensors(self) -> tuple:
        import torch

        g = torch.Generator().manual_seed(self.seed)
        x = (torch.randn(self.n, self.hidden, generator=g) * self.scale).to(torch_dtype(self.x_dtype))  # [N, H]
        weights = torch.rand(self.n, self.k, generator=g).to(torch_dtype(self.w_dtype))  # [N, K]
        routes = torch.randint(-1, self.slots, (self.n, self.k), generator=g, dtype=torch.int32)  # [N, K]
        w13 = torch.randn(self.slots, 2 * self.inter, self.hidden, generator=g) / self.hidden**0.5  # [S,2I,H]
        w2 = torch.randn(self.slots, self.hidden, self.inter, generator=g) / self.inter**0.5  # [S, H, I]
        return x, weights, routes, w13.to(torch_dtype(self.x_dtype)), w2.to(torch_dtype(self.x_dtype))


def _gemm_strategy():
    from hypothesis import strategies as st

    return st.builds(
        GemmCase, n=st.integers(1, 4), k=st.integers(1, 4), hidden=st.sampled_from([8, 24, 64, 96]),
        inter=st.sampled_from([8, 16, 40]), slots=st.integers(1, 6),
        x_dtype=st.sampled_from(["bfloat16", "float32"]), w_dtype=st.sampled_from(["float32", "bfloat16"]),
        scale=st.sampled_from([1.0, 30.0]), small_blocks=st.booleans(), seed=st.integers(0, 2**31 - 1),
        split_first=st.sampled_from([-1, -1, 0, 16, 32]),  # (multiples of SPLIT_GRAIN, as plans make them)
        landing=st.booleans(),
    )


def _gemm_kernel(case: GemmCase, device: str):
    from freetoken.kernels.triton.moe_gemm import moe_slots_gemm

    blocks = {"act_blocks": (8, 16), "down_blocks": (8, 16)} if case.small_blocks else {}
    split = case.split()
    tensors = [t.to(device) for t in case.tensors()]
    landing = case.landing_slots(tensors[2])
    return moe_slots_gemm(*tensors, **blocks, split=split.to(device) if split is not None else None,
                          landing=landing).cpu()


def _gemm_twin(case: GemmCase):
    from freetoken.reference.moe_slots import moe_slots

    return moe_slots(*case.tensors(), split=case.split())


register_kernel(KernelSpec(
    name="moe_slots_gemm", strategy=_gemm_strategy, kernel=_gemm_kernel, twin=_gemm_twin,
    guarantee=Tolerance(rel=2.0**-7, abs=2.0**-16), max_examples=15,
    doc="kernels/triton/moe_gemm.py vs reference/moe_slots.py (fp32 math, summation order differs)",
))


@dataclass(frozen=True)
class FillCase:
    """Two banks (w13-like, w2-like) of `rows` experts, `slots` slots, and a copy plan with -1 holes."""

    rows: int
    slots: int
    row_shapes: tuple[tuple[int, ...], tuple[int, ...]]
    dtype: str
    plan: tuple[tuple[int, int], ...]  # (slot, fid); (-1, -1) = an unused entry
    seed: int
    # (slot, fid, c): with two banks shaped w13 [2I, H] and w2 [H, I], the slot also receives
    # that fid's rows [c, I) (a split miss's GPU share; c a multiple of SPLIT_GRAIN, as plans
    # make them); slot -1: a split row saying none
    split: tuple[int, int, int] | None = None

    def banks(self) -> tuple[list, list]:
        import torch

        g = torch.Generator().manual_seed(self.seed)

        def bank(rows: int, shape: tuple[int, ...]):
            return torch.randint(0, 256, (rows, *shape, torch_dtype(self.dtype).itemsize), generator=g,
                                 dtype=torch.uint8).view(torch_dtype(self.dtype)).squeeze(-1)

        host = [bank(self.rows, shape) for shape in self.row_shapes]
        return host, [bank(self.slots, shape) for shape in self.row_shapes]


def _fill_strategy():
    from hypothesis import strategies as st

    from freetoken.reference.expert_cache import SPLIT_GRAIN

    @st.composite
    def cases(draw: Callable) -> FillCase:
        rows, slots = draw(st.integers(1, 12)), draw(st.integers(1, 8))
        # one to three banks of different row sizes: a launch fills two, a lone one goes alone
        shapes = tuple(draw(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 40)), min_size=1, max_size=3)))
        # a plan never names a slot twice
        used = draw(st.lists(st.integers(0, slots - 1), unique=True, max_size=slots))
        plan = [(s, draw(st.integers(0, rows - 1))) for s in used] + [(-1, -1)] * draw(st.integers(0, 3))
        plan = draw(st.permutations(plan)) if plan else [(-1, -1)]
        dtype = draw(st.sampled_from(["bfloat16", "float32", "uint8"]))
        split = None
        if draw(st.booleans()):  # w13/w2-shaped banks; the split takes a slot the plan leaves alone
            inter, hidden = SPLIT_GRAIN * draw(st.integers(1, 4)), 4 * draw(st.integers(1, 10))
            shapes = ((2 * inter, hidden), (hidden, inter))
            free = [s for s in range(slots) if s not in used]
            split = (draw(st.sampled_from(free)) if free and draw(st.booleans()) else -1,
                     draw(st.integers(0, rows - 1)), SPLIT_GRAIN * draw(st.integers(0, inter // SPLIT_GRAIN - 1)))
        return FillCase(rows, slots, shapes, dtype, tuple(plan), draw(st.integers(0, 2**31 - 1)), split)

    return cases()


def _fill_kernel(case: FillCase, device: str) -> list:
    import torch

    from freetoken.kernels.triton.slot_fill import fill_slots

    host, slots = case.banks()
    if device != "cpu":
        host = [h.pin_memory() for h in host]
    slots = [s.to(device) for s in slots]
    plan = torch.tensor(case.plan, dtype=torch.int32, device=device)  # [P, 2]
    split = None
    if case.split is not None:
        slot, fid, first = case.split
        split = torch.tensor([slot, fid, first, case.row_shapes[1][1] - first], dtype=torch.int32, device=device)
    fill_slots(plan[:, 0].contiguous(), plan[:, 1].contiguous(), host, slots, split=split)
    return [s.cpu() for s in slots]


def _fill_twin(case: FillCase) -> list:
    host, slots = case.banks()
    for slot, fid in case.plan:
        if slot >= 0:
            for h, s in zip(host, slots, strict=True):
                s[slot] = h[fid]
    if case.split is not None and case.split[0] >= 0:
        slot, fid, first = case.split
        inter = case.row_shapes[1][1]
        (h13, h2), (s13, s2) = host, slots
        s13[slot, first:inter] = h13[fid, first:inter]
        s13[slot, inter + first :] = h13[fid, inter + first :]
        s2[slot, :, first:] = h2[fid, :, first:]
    return slots


register_kernel(KernelSpec(
    name="slot_fill", strategy=_fill_strategy, kernel=_fill_kernel, twin=_fill_twin, guarantee=BIT_EXACT,
    max_examples=15, doc="kernels/triton/slot_fill.py vs indexed assignment",
))


@dataclass(frozen=True)
class TallyCase:
    """A counter row before, and one plan's counts and routes [N][K] (-1: the CPU's)."""

    row: tuple[int, ...]  # 7 int64 counters
    counts: tuple[int, ...]  # 4 int32 plan counts
    routes: tuple[tuple[int, ...], ...]
    split: tuple[int, ...] = (-1, -1, -1, -1)  # the plan's split row (slot, fid, CPU rows, GPU rows)


def _tally_strategy():
    from hypothesis import strategies as st

    @st.composite
    def cases(draw: Callable) -> TallyCase:
        n, k = draw(st.integers(1, 64)), draw(st.integers(1, 8))
        route = st.sampled_from([-1, 0, 3]) | st.integers(-1, 5000)
        routes = tuple(tuple(draw(route) for _ in range(k)) for _ in range(n))
        row = tuple(draw(st.sampled_from([0, 2**40 + 7]) | st.integers(0, 2**50)) for _ in range(7))
        counts = tuple(draw(st.integers(0, 2**20)) for _ in range(4))
        gpu_rows = draw(st.integers(1, 1 << 14))
        split = draw(st.sampled_from([(-1, -1, -1, -1), (7, 3, 32, gpu_rows), (100, 0, 64, gpu_rows)]))
        return TallyCase(row, counts, routes, split)

    return cases()


def _tally_kernel(case: TallyCase, device: str):
    import torch

    from freetoken.kernels.triton.plan import DevicePlan, tally_plan

    row = torch.tensor(case.row, dtype=torch.int64, device=device)
    counts = torch.tensor(case.counts, dtype=torch.int32, device=device)
    routes = torch.tensor(case.routes, dtype=torch.int32, device=device)
    unused = torch.empty(0, dtype=torch.int32, device=device)
    split = torch.tensor(case.split, dtype=torch.int32, device=device)
    tally_plan(row, DevicePlan(routes=routes, copy_slots=unused, copy_fids=unused, background_slots=unused,
                               counts=counts, gemm_routes=routes, split=split))
    return row.cpu()


def _tally_twin(case: TallyCase):
    import torch

    from freetoken.kernels.triton.plan import tally_plan_torch

    row = torch.tensor(case.row, dtype=torch.int64)
    tally_plan_torch(row, torch.tensor(case.counts, dtype=torch.int32), torch.tensor(case.routes, dtype=torch.int32),
                     torch.tensor(case.split, dtype=torch.int32))
    return row


register_kernel(KernelSpec(
    name="plan_tally", strategy=_tally_strategy, kernel=_tally_kernel, twin=_tally_twin, guarantee=BIT_EXACT,
    max_examples=15, doc="kernels/triton/plan.py's tally of a captured layer's counters vs the torch expressions",
))


@dataclass(frozen=True)
class RoundCase:
    bits: tuple[int, ...]  # fp32 bit patterns

    def values(self):
        import torch

        return torch.tensor(self.bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _round_strategy():
    from hypothesis import strategies as st

    word = st.integers(0, 2**32 - 1)
    tie_heavy = st.builds(lambda hi, lo: hi << 16 | lo, st.integers(0, 2**16 - 1),
                          st.sampled_from([0, 0x7FFF, 0x8000, 0x8001, 0xFFFF]))
    return st.builds(RoundCase, st.lists(word | tie_heavy, min_size=1, max_size=300).map(tuple))


def _round_kernel(case: RoundCase, device: str):
    from freetoken.kernels.triton.moe_gemm import round_to_bf16

    return round_to_bf16(case.values().to(device)).cpu()


register_kernel(KernelSpec(
    name="bf16_round", strategy=_round_strategy, kernel=_round_kernel,
    twin=lambda case: case.values().to(torch_dtype("bfloat16")), guarantee=BIT_EXACT, max_examples=20,
    doc="the rne_bf16 store helper vs torch's CPU cast (NaN payloads aside)",
))
