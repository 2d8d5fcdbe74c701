"""The plan's pair (kernels/triton/plan.py against reference/expert_cache.py's `plan_layer`),
and what the pairs built on a plan share: its case type, case strategy, counter start, the
record a step leaves and the twin run over a case.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass

from freetoken.kernels.registry import BIT_EXACT, KernelSpec, register_kernel
from freetoken.reference.fetch_rule import FetchRule


@dataclass(frozen=True)
class PlanCase:
    """A cache of L*E experts and S slots, a starting state, and a sequence of plans."""

    num_layers: int
    num_experts: int
    num_slots: int
    placed: tuple[tuple[int, int], ...]  # (fid, slot) put in the cache before the first plan
    start_step: int  # the step counter before the first plan (last_* of placed fids lie below it)
    steps: tuple[tuple[int, tuple[tuple[int, ...], ...], FetchRule, int], ...]  # (layer, ids [N][K], rule, r)
    tally: bool = False  # the kernel also adds each plan to a counter row (the captured layers' way)

    def initial_state(self):
        from freetoken.reference.expert_cache import CacheState

        state = CacheState(self.num_layers, self.num_experts, self.num_slots)
        for i, (fid, slot) in enumerate(self.placed):
            state.place(fid, slot)
            state.last_used[slot] = state.last_active[fid] = (i * 7919) % (self.start_step + 1)
        state.step = self.start_step
        return state


def plan_strategy():
    from hypothesis import strategies as st

    @st.composite
    def cases(draw: Callable) -> PlanCase:
        L, E = draw(st.integers(1, 4)), draw(st.integers(2, 16))
        S = draw(st.integers(E, L * E))
        K = draw(st.integers(1, min(8, E)))
        max_n = draw(st.integers(1, 8))
        rules = draw(st.lists(st.sampled_from(list(FetchRule)), min_size=1, max_size=3, unique=True))
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
            steps.append((layer, tuple(rows), rng.choice(rules), r))
        return PlanCase(L, E, S, placed, draw(st.sampled_from([0, 5, 1000])), tuple(steps), draw(st.booleans()))

    return cases()


TALLY_START = 2**40 + 7  # every counter of the row starts here: sums beyond 32 bits


def plan_record(routes: list, copy_slots: list[int], copy_fids: list[int], background_slots: list[int],
                counts: list[int], state, tally: list[int] | None) -> dict:
    # counts: hits, misses, fetched; the background fills' count apart (older cases read three)
    return {"routes": routes, "copy_slots": copy_slots, "copy_fids": copy_fids,
            "background_slots": background_slots, "counts": counts[:3], "background": counts[3],
            "state": asdict(state), "tally": tally}


def _plan_kernel(case: PlanCase, device: str) -> list[dict]:
    import torch

    from freetoken.kernels.device_cache_state import DeviceCacheState
    from freetoken.kernels.triton.plan import plan_layer_device

    state = DeviceCacheState.from_reference(case.initial_state(), device)
    rows = torch.full((case.num_layers, 6), TALLY_START, dtype=torch.int64, device=device)
    out = []
    for layer, ids, rule, ratio in case.steps:
        ids_t = torch.tensor(ids, device=device)  # [N, K]
        plan = plan_layer_device(state, layer, ids_t, rule, ratio, tally=rows[layer] if case.tally else None)
        out.append(plan_record(plan.routes.tolist(), plan.copy_slots.tolist(), plan.copy_fids.tolist(),
                               plan.background_slots.tolist(), plan.counts.tolist(), state.to_reference(),
                               rows[layer].tolist() if case.tally else None))
    return out


def plan_twin(case: PlanCase) -> list[dict]:
    from freetoken.reference.expert_cache import plan_layer

    state = case.initial_state()
    rows = [[TALLY_START] * 6 for _ in range(case.num_layers)]
    out = []
    for layer, ids, rule, ratio in case.steps:
        plan = plan_layer(state, layer, [list(row) for row in ids], rule, ratio)
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
        rows[layer] = [a + b for a, b in zip(rows[layer], [*counts, cpu_routes, width], strict=True)]
        out.append(plan_record(plan.routes, slots, fids, background, counts, state,
                               list(rows[layer]) if case.tally else None))
    return out


register_kernel(KernelSpec(
    name="plan", strategy=plan_strategy, kernel=_plan_kernel, twin=plan_twin, guarantee=BIT_EXACT,
    max_examples=12,
    doc="kernels/triton/plan.py vs reference/expert_cache.py: outputs, state and (drawn) the counter row, every step",
))
