"""Split misses (reference/expert_cache.py, step 9): where q* rounds a layer's PCIe share down,
the first miss it leaves to the CPU is split by its intermediate rows, and the slot GEMM reads
the GPU's share from the scratch slot. The rule on hand-picked layers, the id packing, and the
engine: the same tokens as without splitting, with splits really made."""

from __future__ import annotations

import pytest

from freetoken.config import EngineConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.reference.expert_cache import (
    SPLIT_GRAIN,
    CacheState,
    pack_split_id,
    plan_layer,
    qstar,
    split_gpu_units,
    unpack_split_id,
)
from tests.test_placement_invariance import _greedy

R = 31000  # r = 0.473, the H200's measured PCIe share
UNITS = 48  # a 768-row expert


def _full_cache(num_experts: int = 16, num_slots: int = 4) -> CacheState:
    """A layer whose slots hold experts 0..3, used long ago: every other expert misses."""
    state = CacheState(1, num_experts, num_slots)
    for slot in range(num_slots):
        state.place(slot, slot)
        state.last_used[slot] = 1
    state.step = 10
    return state


def test_three_misses_split_the_one_q_star_leaves_to_the_cpu() -> None:
    misses = [5, 6, 7]
    assert qstar(3, R) == (3 * R) >> 16 == 1  # q* rounds 1.42 down: one fetch, two on the CPU
    state = _full_cache()
    state.last_active[7] = 9  # the most recently active miss comes first, then by fid
    plan = plan_layer(state, 0, [misses], "hybrid", R, fetch_recurring=False, split_units=UNITS)
    gpu_units = split_gpu_units(3, R, UNITS)
    assert 0 < gpu_units < UNITS
    assert plan.copies == [(0, 7)] and plan.split == (5, (UNITS - gpu_units) * SPLIT_GRAIN)
    assert plan.routes == [[-1, -1, 0]]  # the split miss stays a CPU route ...
    assert plan.gemm_routes == [[4, -1, 0]]  # ... whose GPU share the scratch slot (index S) holds
    assert state.slot_of[5] == -1 and 4 not in state.slot_of  # the scratch slot is outside the cache
    assert plan.fetched == 1 and plan.on_cpu == 2


def test_the_split_balances_the_two_branches() -> None:
    """PCIe carries the whole fetch plus the GPU's share, the CPU the rest: M * r to the unit."""
    for misses in range(1, 12):
        lo = (misses * R) >> 16
        units = split_gpu_units(misses, R, UNITS)
        exact = misses * R / 65536 - lo
        assert abs(units / UNITS - exact) <= 0.5 / UNITS


def test_no_split_where_q_star_rounds_up_or_everything_is_fetched() -> None:
    assert qstar(2, R) == 1 != (2 * R) >> 16  # q* rounds 0.95 up: the link is the longer branch
    plan = plan_layer(_full_cache(), 0, [[5, 6]], "hybrid", R, fetch_recurring=False, split_units=UNITS)
    assert plan.split is None and plan.gemm_routes == plan.routes
    # background fills where q* fetches nothing: every miss is fetched, none is left to split
    plan = plan_layer(_full_cache(), 0, [[5]], "hybrid", R, background=True, split_units=UNITS)
    assert plan.split is None and len(plan.background) == 1
    # off, and where the share rounds to no unit or to all of them
    assert plan_layer(_full_cache(), 0, [[5, 6, 7]], "hybrid", R, fetch_recurring=False).split is None
    assert plan_layer(_full_cache(), 0, [[5, 6, 7]], "hybrid", R, fetch_recurring=False, split_units=1).split is None
    for policy in ("transfer", "cpu", "static"):
        assert plan_layer(_full_cache(), 0, [[5, 6, 7]], policy, R, split_units=UNITS).split is None


def test_split_ids_pack_and_unpack() -> None:
    assert pack_split_id(1234, 0) == 1234 and unpack_split_id(1234, 768) == (1234, 768)
    packed = pack_split_id(1234, 3 * SPLIT_GRAIN)
    assert packed > 1234 and unpack_split_id(packed, 768) == (1234, 3 * SPLIT_GRAIN)
    with pytest.raises(ValueError):
        pack_split_id(1234, SPLIT_GRAIN + 1)  # not a whole unit
    with pytest.raises(ValueError):
        pack_split_id(1 << 20, SPLIT_GRAIN)  # a fid beyond the packed width


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_engine_splits_misses_and_computes_the_same(arch, make_checkpoint) -> None:
    """Hybrid at r = 0.5 over a small cache: odd miss counts split one expert (tiny's 48 rows, 3
    units: the GPU takes 2). Tokens equal those without splitting, logits within the invariance
    test's tolerance; the counters show splits made and their rows."""
    model_dir = make_checkpoint(arch, "tiny", seed=4)
    runs = {}
    for split in (True, False):
        config = EngineConfig(device="cpu", dtype="float32", max_model_len=64, moe_policy="hybrid",
                              moe_cache_slots=8, moe_ratio=0.5, cpu_threads=1, moe_fetch_recurring=False,
                              moe_split_misses=split)
        runner = ModelRunner(str(model_dir), config, rows=1)
        tokens, logits = _greedy(runner, [7, 3, 11, 200, 5, 17, 42, 99], steps=24)
        runs[split] = tokens, logits, runner.slots.stats, runner.slots.w13.shape[0], runner.slots.num_slots
        runner.close()
    tokens, logits, stats, rows, slots = runs[True]
    plain_tokens, plain_logits, plain_stats, plain_rows, _ = runs[False]
    assert tokens == plain_tokens
    assert (logits - plain_logits).abs().max() / plain_logits.abs().max() < 1e-4
    assert sum(stats.split_gpu_rows) > 0 and sum(stats.split_gpu_rows) % (2 * SPLIT_GRAIN) == 0
    assert sum(plain_stats.split_gpu_rows) == 0
    assert rows == slots + 1 and plain_rows == slots  # the scratch slot, only where misses split


def test_no_split_where_the_layer_already_waits_for_more_than_lo() -> None:
    """Without background fills, recurring misses are waited for: with two of three recurring the
    layer waits for two fetches (M * r = 1.42), and a split would lengthen the longer branch."""
    def plan(background: bool):
        state = _full_cache()
        state.last_active[5] = state.last_active[6] = 5  # routed after the LRU slot's last use (1)
        return plan_layer(state, 0, [[5, 6, 7]], "hybrid", R, background=background, split_units=UNITS)

    waits = plan(background=False)
    assert len(waits.copies) == 2 and waits.split is None
    # with background fills the layer waits for q*'s one, fetches the other recurring one for
    # later steps, and splits the miss left unfetched
    later = plan(background=True)
    assert len(later.copies) == 1 and len(later.background) == 1 and later.split is not None
    assert later.split[0] == 7
