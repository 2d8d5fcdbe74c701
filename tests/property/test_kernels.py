"""Every registered Triton kernel against its twin (Hypothesis), plus the plan's edge cases.

Guarantees are the registry's: bit-exact for the plan, the slot fill and the bf16 rounding
helper; the stated tolerance for the MoE GEMM. On CPU the kernels run in the interpreter.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from freetoken.kernels.check_cli import add_kernels_arguments, run_kernels_check
from freetoken.kernels.registry import BIT_EXACT, KernelSpec, check_case, check_kernel, register_kernel
from freetoken.kernels.specs import load_all_specs
from freetoken.kernels.specs.dense import RouteCase
from freetoken.kernels.specs.plan import PlanCase
from freetoken.reference.fetch_rule import FetchRule

REGISTRY = load_all_specs()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_kernel_matches_twin(name: str) -> None:
    report = check_kernel(name, DEVICE)
    assert report.passed, report.summary()


def _sequence(L: int, E: int, S: int, rule: FetchRule, ratio: int = 32768, *, steps: int = 64, n: int = 4,
              k: int = 2, placed: tuple = (), same_rows: bool = False, seed: int = 0) -> PlanCase:
    rng = random.Random(seed)
    plans = []
    for _ in range(steps):
        layer = rng.randrange(L)
        rows = [tuple(rng.sample(range(E), k)) for _ in range(rng.randint(1, n))]
        if same_rows:
            rows = [rows[0]] * len(rows)
        plans.append((layer, tuple(rows), rule, ratio))
    return PlanCase(L, E, S, tuple(placed), 0, tuple(plans))


def _counts(case: PlanCase) -> list[tuple[int, int, int]]:
    """(hits, misses, fetched) per step, from the twin: to confirm what each edge case exercises."""
    return [tuple(record["counts"]) for record in REGISTRY["plan"].twin(case)]


def _recurring(fetch: bool, ratio: int = 20000, period: int = 1, plans: int = 3, full: bool = True,
               background: bool = False) -> PlanCase:
    """Layer 0, one token a plan, cycling through `period` experts: q*(1) = 0 at this ratio.
    full: layer 1's experts fill every slot first (no free victim), else the cache starts empty.
    fetch: hybrid's recurring rule (else q* alone); background: its fetches beyond q* in the background."""
    rule = (FetchRule.QSTAR_BACKGROUND if background else FetchRule.QSTAR_RECURRING) if fetch else FetchRule.QSTAR
    steps = tuple((0, ((3 + i % period,),), rule, ratio) for i in range(plans))
    placed = tuple((16 + slot, slot) for slot in range(16)) if full else ()
    return PlanCase(2, 16, 16, placed, 0, steps)


# label -> (case, what the twin's counts must show for the case to test what its label says)
PLAN_EDGES = {
    "one layer's worth of slots (S == E)": (
        _sequence(3, 8, 8, FetchRule.ALL, n=6, k=4), lambda c: sum(f for _, _, f in c) > 64),
    "every expert fits (S == L*E)": (
        _sequence(3, 6, 18, FetchRule.ALL, n=3, k=3), lambda c: all(m == f for _, m, f in c)),
    "hybrid, ratio 0: nothing fetched": (
        _sequence(2, 8, 10, FetchRule.QSTAR_RECURRING, 0), lambda c: all(f == 0 < m for _, m, f in c)),
    "hybrid, ratio 65536: every miss fetched": (
        _sequence(2, 8, 10, FetchRule.QSTAR_RECURRING, 65536, n=8, k=4), lambda c: sum(m for _, m, _ in c) > 64),
    "hybrid, ratio 1/2: q* cost ties": (
        _sequence(2, 8, 9, FetchRule.QSTAR_RECURRING, 32768, n=5, k=3, seed=3), lambda c: any(m % 2 for _, m, _ in c)),
    "hybrid fetches recurring misses beyond q*": (
        _recurring(True, period=5, plans=40), lambda c: [f for _, _, f in c[5:10]] == [1] * 5),
    "hybrid, q* alone": (
        _recurring(False, period=5, plans=40), lambda c: all(f == 0 < m for _, m, f in c)),
    "hybrid fills free slots with first-seen misses": (
        _recurring(True, period=5, plans=40, full=False), lambda c: [f for _, _, f in c[:5]] == [1] * 5),
    "all hits (resident, every expert placed)": (
        _sequence(2, 5, 10, FetchRule.ALL, placed=[(f, 9 - f) for f in range(10)], n=8, k=5),
        lambda c: all(m == 0 for _, m, _ in c)),
    "static placement, misses to the CPU": (
        _sequence(4, 4, 6, FetchRule.NONE, placed=[(f, f) for f in range(6)]),
        lambda c: all(f == 0 for _, _, f in c) and any(h for h, _, _ in c) and any(m for _, m, _ in c)),
    "repeated ids across tokens": (
        _sequence(2, 16, 12, FetchRule.ALL, n=8, k=8, same_rows=True),
        lambda c: all(h + m <= 8 for h, m, _ in c)),
    "16 experts, 8 tokens x top-8": (
        _sequence(4, 16, 20, FetchRule.QSTAR_RECURRING, 40000, n=8, k=8, seed=7),
        lambda c: max(m for _, m, _ in c) >= 12),
}


def test_recurring_miss_is_fetched_within_the_lru_horizon() -> None:
    """The specification's R (step 3): a lone miss goes to the CPU the first time (q*(1) = 0
    below r = 1/2) and is fetched when it recurs, if it was routed more recently than the LRU
    victim slot was used (plain LRU would still hold it); one routed before that is not."""
    from freetoken.reference.expert_cache import CacheState, plan_layer
    from freetoken.reference.fetch_rule import FetchRule

    twin = REGISTRY["plan"].twin
    assert [r["counts"] for r in twin(_recurring(True))] == [[0, 1, 0], [0, 1, 1], [1, 0, 0]]
    assert [r["counts"] for r in twin(_recurring(False))] == [[0, 1, 0]] * 3  # q* alone: CPU forever
    assert [r["counts"] for r in twin(_recurring(True, ratio=0))] == [[0, 1, 0]] * 3  # no PCIe, no fetch

    def full_cache() -> CacheState:  # slots used at steps 10 and 12; expert 3 routed at 11, expert 4 at 9
        state = CacheState(1, 16, 2)
        state.place(5, 0)
        state.place(6, 1)
        state.last_used[:] = [10, 12]
        state.last_active[3], state.last_active[4], state.step = 11, 9, 12
        return state

    inside = plan_layer(full_cache(), 0, [[3]], FetchRule.QSTAR_RECURRING, 20000)  # horizon 10 < 11
    assert inside.copies == [(0, 3)] and inside.routes == [[0]]  # evicts expert 5 (slot 0, used at 10)
    beyond = plan_layer(full_cache(), 0, [[4]], FetchRule.QSTAR_RECURRING, 20000)
    assert beyond.copies == [] and beyond.routes == [[-1]]
    assert plan_layer(full_cache(), 0, [[3]], FetchRule.QSTAR, 20000).copies == []


def test_free_slots_take_first_seen_misses() -> None:
    """The specification's Z (step 3): with free victim slots, hybrid fetches first-seen misses
    up to their number (plain LRU would hold them, and they evict nothing); q* splits the rest."""
    from freetoken.reference.expert_cache import CacheState, plan_layer
    from freetoken.reference.fetch_rule import FetchRule

    twin = REGISTRY["plan"].twin
    assert [r["counts"] for r in twin(_recurring(True, full=False))] == [[0, 1, 1], [1, 0, 0], [1, 0, 0]]
    assert [r["counts"] for r in twin(_recurring(False, full=False))] == [[0, 1, 0]] * 3  # q* alone
    assert [r["counts"] for r in twin(_recurring(True, ratio=0, full=False))] == [[0, 1, 0]] * 3

    state = CacheState(1, 16, 3)  # slot 1 holds expert 9 (used at step 4); slots 0 and 2 are free
    state.place(9, 1)
    state.last_used[1], state.step = 4, 5
    plan = plan_layer(state, 0, [[1, 2, 3, 4, 5]], FetchRule.QSTAR_RECURRING, 20000)  # q*(5) = 1 at this ratio
    assert plan.fetched == 2 and [slot for slot, _ in plan.copies] == [0, 2]  # both free slots, no eviction
    assert state.slot_of[9] == 1 and plan.routes[0].count(-1) == 3


def test_background_fills_leave_this_step_on_the_cpu() -> None:
    """Background fills (step 3): q* alone decides what the layer waits for; the misses R and Z
    add beyond it are fetched for later steps, so this step computes them on the CPU."""
    from freetoken.reference.expert_cache import CacheState, plan_layer
    from freetoken.reference.fetch_rule import FetchRule

    state = CacheState(1, 16, 3)  # as in test_free_slots_take_first_seen_misses
    state.place(9, 1)
    state.last_used[1], state.step = 4, 5
    plan = plan_layer(state, 0, [[1, 2, 3, 4, 5]], FetchRule.QSTAR_BACKGROUND, 20000)  # q*(5) = 1
    assert plan.fetched == 2 and plan.copies == [(0, 1)] and plan.background == [(2, 2)]
    assert plan.routes == [[0, -1, -1, -1, -1]] and plan.on_cpu == 4  # expert 2 on the CPU this step
    assert state.slot_of[2] == 2  # ... and in the cache for the next
    again = plan_layer(state, 0, [[2]], FetchRule.QSTAR_BACKGROUND, 20000)
    assert again.hits == 1 and again.routes == [[2]]

    # A lone miss (q*(1) = 0) runs on the CPU when first seen; when it recurs, R fetches it in
    # the background (this step still computes it on the CPU) instead of a fetch the layer waits for.
    twin = REGISTRY["plan"].twin
    steps = twin(_recurring(True, background=True))
    assert [r["counts"] for r in steps] == [[0, 1, 0], [0, 1, 1], [1, 0, 0]]
    assert steps[1]["routes"] == [[-1]] and steps[1]["background"] == 1 and steps[2]["routes"] != [[-1]]
    assert [r["counts"] for r in twin(_recurring(True))] == [[0, 1, 0], [0, 1, 1], [1, 0, 0]]  # waits instead


def test_a_split_that_fetches_nothing_sends_no_first_seen_miss_over_the_link() -> None:
    """Below r = 1/3 q*(3) = 0. The layer's idle link time is then under one fill (q* balances the
    branches), so first-seen misses in a full cache (no R, no Z) are not fetched in the background
    either: the CPU computes them and the link carries nothing this layer cannot use."""
    from freetoken.reference.expert_cache import CacheState, plan_layer, qstar
    from freetoken.reference.fetch_rule import FetchRule

    ratio = 14418  # r = 0.22
    assert qstar(3, ratio) == 0
    state = CacheState(2, 16, 4)
    for slot in range(4):  # layer 1's experts fill the cache, used long ago
        state.place(16 + slot, slot)
    state.step = 10
    plan = plan_layer(state, 0, [[1, 2, 3]], FetchRule.QSTAR_BACKGROUND, ratio)
    assert plan.fetched == 0 and plan.background == [] and plan.on_cpu == 3


@given(misses=st.integers(0, 10_000), ratio=st.integers(0, 65536))
def test_a_layer_leaves_the_link_idle_for_less_than_one_fill(misses: int, ratio: int) -> None:
    """Why hybrid fetches nothing beyond q* but R and Z (specification, step 3): with q* waited for,
    the CPU's share outlasts the link's by at most one expert's fill (exactly one only at a tie)."""
    from freetoken.reference.expert_cache import Q16, qstar

    q = qstar(misses, ratio)
    idle = (misses - q) * ratio - q * (Q16 - ratio)
    assert idle <= Q16 - ratio


@pytest.mark.parametrize("label", sorted(PLAN_EDGES))
def test_plan_edge_case(label: str) -> None:
    case, exercised = PLAN_EDGES[label]
    assert exercised(_counts(case)), "the case no longer tests what its label says"
    assert check_case("plan", case, DEVICE) is None


def test_plan_tallies_the_counter_row_in_its_launch() -> None:
    """A captured layer's plan adds itself to the layer's counter row (hits, misses, fetched,
    background, CPU routes, routes) in the plan's launch; the row runs over 32 bits and holds
    every step of the case, background fills and CPU routes included."""
    case = replace(_sequence(2, 8, 9, FetchRule.QSTAR_BACKGROUND, 20000, n=5, k=3, seed=3), tally=True)
    records = REGISTRY["plan"].twin(case)
    last = {}
    for (layer, _, _, _), record in zip(case.steps, records, strict=True):
        last[layer] = record["tally"]
    routes = sum(len(ids) * len(ids[0]) for _, ids, _, _ in case.steps)
    assert sum(row[5] for row in last.values()) - 2 * (2**40 + 7) == routes
    assert all(row[3] > 2**40 + 7 and row[4] > 2**40 + 7 for row in last.values())  # background, CPU routes
    assert check_case("plan", case, DEVICE) is None
    kernel = REGISTRY["plan"].kernel(replace(case, tally=False), DEVICE)
    assert all(record["tally"] is None for record in kernel)


def test_harness_reports_a_shrunk_counterexample() -> None:
    from hypothesis import strategies as st

    spec = register_kernel(KernelSpec(
        name="_off_by_one_above_5", strategy=lambda: st.integers(0, 1000),
        kernel=lambda case, device: case + (case > 5), twin=lambda case: case, guarantee=BIT_EXACT,
    ))
    try:
        report = check_kernel(spec.name, DEVICE, max_examples=200, seed=1)
    finally:
        del REGISTRY[spec.name]
    assert not report.passed and report.counterexample == 6, report.summary()
    assert "kernel 7, twin 6" in report.message


def test_cli_check_one_kernel(capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    add_kernels_arguments(parser)
    args = parser.parse_args(["check", "bf16_round", "--device", DEVICE, "--examples", "3", "--seed", "0"])
    assert run_kernels_check(args) == 0
    assert "bf16_round [bit-exact]" in capsys.readouterr().out


def test_registry_import_is_light() -> None:
    code = ("import sys, freetoken.kernels.registry; "
            "print([m for m in ('torch', 'triton', 'hypothesis') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_device_state_round_trip() -> None:
    from freetoken.kernels.device_cache_state import DeviceCacheState

    ref = PLAN_EDGES["all hits (resident, every expert placed)"][0].initial_state()
    ref.step = 12
    assert DeviceCacheState.from_reference(ref, DEVICE).to_reference() == ref


ROUTE_EDGES = {
    "the kernel's limits (1024 experts, top-32)": RouteCase(3, 1024, 32, "float32", True, True, 1.0, 0, False, 5),
    "ties, +-0 and -inf reached by the top-k": RouteCase(4, 8, 8, "bfloat16", True, False, 1.0, 1, True, 6),
    "every expert tied (+0 and -0)": RouteCase(2, 60, 8, "float32", False, True, 0.0, 1, False, 7),
    "one expert": RouteCase(5, 1, 1, "bfloat16", True, False, 30.0, 0, False, 8),
    "bf16, one-hot scale, masked": RouteCase(9, 64, 6, "bfloat16", False, False, 30.0, 0, True, 9),
}


@pytest.mark.parametrize("label", sorted(ROUTE_EDGES))
def test_route_edge_case(label: str) -> None:
    assert check_case("route", ROUTE_EDGES[label], DEVICE) is None


def test_route_compare_holds_ids_exact_and_bf16_to_one_ulp() -> None:
    spec = REGISTRY["route"]
    ids = torch.tensor([[3, 1], [0, 250]])
    w32 = torch.tensor([[0.75, 0.25], [0.5, 1e-3]])
    w16 = w32.to(torch.bfloat16)

    def compare(got_w, got_ids, want_w=w32, want_ids=ids):
        return spec.compare((got_w, got_ids), (want_w, want_ids), spec.guarantee)

    assert compare(w32, ids) is None
    assert "out[1][1, 1]" in compare(w32, ids + torch.tensor([[0, 0], [0, 1]]))  # no tolerance hides an id
    assert compare(w32 * (1 + 2**-21), ids) is None
    assert "out[0]" in compare(w32 * (1 + 2**-18), ids)
    one_ulp_up = (w16.view(torch.int16) + 1).view(torch.bfloat16)
    two_ulps_up = (w16.view(torch.int16) + 2).view(torch.bfloat16)
    assert compare(one_ulp_up, ids, w16) is None
    assert "more than one bf16 ulp" in compare(two_ulps_up, ids, w16)
    assert "kernel torch.float32" in compare(w32, ids, w16)  # the output dtype must match


def test_fused_route_rejects_what_it_cannot_do() -> None:
    from freetoken.kernels.triton.routing import fused_route

    logits = torch.zeros(2, 64, device=DEVICE)
    for bad in [
        (logits[0], 2),  # not [N, E]
        (logits.half(), 2),  # dtype
        (logits, 0),
        (logits, 33),  # K > 32
        (torch.zeros(2, 4, device=DEVICE), 5),  # K > E
        (torch.zeros(1, 1025, device=DEVICE), 2),  # E > 1024
    ]:
        with pytest.raises(ValueError):
            fused_route(*bad, True, True)
    weights, ids = fused_route(torch.zeros(0, 8, device=DEVICE), 2, True, False)
    assert weights.shape == ids.shape == (0, 2)


def test_decode_attention_output_bound_scales_with_the_values() -> None:
    # An H200 draw where the output (an average of values, max|out| 2.4) moved by more than
    # 2^-9 max|out| while max|v| was 8.9: the probabilities' rounding is bounded by the values.
    from freetoken.kernels.specs.dense import DecodeAttentionCase

    case = DecodeAttentionCase(batch=3, kv_heads=1, group=4, head_dim=256, key_len=20, splits=0, norm=True,
                               dtype="bfloat16", seed=561)
    spec = REGISTRY["decode_attention"]
    got, want = spec.kernel(case, DEVICE), spec.twin(case)
    assert spec.compare(got, want, spec.guarantee) is None
    broken = list(got)
    broken[3] = got[3].clone()
    broken[3][1, 960] += 0.1  # what one key's weight too many or too few would move
    assert spec.compare(broken, want, spec.guarantee) is not None


@pytest.mark.parametrize("programs", [1, 3, 256])
def test_slot_fill_copies_rows_split_into_parts(monkeypatch, programs: int) -> None:
    # The registered cases' rows fit in one BLOCK; with 4-word blocks each row takes many parts,
    # and with few programs each program strides over several (two banks of different sizes
    # share a launch: the smaller must be copied whole and never overrun).
    import functools

    from freetoken.kernels.triton import slot_fill

    monkeypatch.setattr(slot_fill, "BLOCK", 4)
    monkeypatch.setattr(slot_fill, "fill_slots", functools.partial(slot_fill.fill_slots, programs_per_copy=programs))
    report = check_kernel("slot_fill", DEVICE, max_examples=10)
    assert report.passed, report.summary()


def test_router_linear_takes_the_kernel_for_decode_rows_only() -> None:
    import torch.nn.functional as F

    from freetoken.kernels.triton.decode_linear import MAX_ROWS, decode_linear, linear

    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 40, generator=g).to(torch.bfloat16).to(DEVICE)
    few, many = (torch.randn(rows, 40, generator=g).to(torch.bfloat16).to(DEVICE) for rows in (MAX_ROWS, MAX_ROWS + 1))
    assert torch.equal(linear(few, w), decode_linear(few, w))
    assert torch.equal(linear(many, w), F.linear(many, w))  # a prompt's rows: cuBLAS (torch)
    assert torch.equal(linear(few, w.T.contiguous().T), F.linear(few, w))  # a strided weight: torch
    with pytest.raises(ValueError):
        decode_linear(many, w)
    with pytest.raises(ValueError):  # F.linear refuses mixed dtypes too
        decode_linear(few.float(), w)
    bias = torch.randn(12, generator=g).to(torch.bfloat16).to(DEVICE)[::2]  # a strided view
    assert torch.equal(decode_linear(few, w, bias), decode_linear(few, w, bias.contiguous()))


@pytest.mark.parametrize("name", ["gated_delta_recurrent", "gated_delta_chunked", "causal_conv"])
def test_linear_attention_kernels_leave_read_only_rows_slots_as_they_were(name: str) -> None:
    """A captured step's padding rows (-(s + 1)): some rows read-only, then every row."""
    from freetoken.kernels.specs.linear_attention import CausalConvCase, GatedDeltaCase

    for read_only in (1, 3):
        if name == "causal_conv":
            case = CausalConvCase(3, 1, 40, 4, "float32", False, 9, read_only=read_only)
        else:
            case = GatedDeltaCase(3, 2 if name.endswith("recurrent") else 70, 2, 16, 24, "float32", 1.0, False, 9,
                                  read_only=read_only, group=2)  # (and key heads serving two value heads each)
        assert check_case(name, case, DEVICE) is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_attention_takes_gated_attention_heads(dtype: str) -> None:
    """Qwen3.5/Next's heads: zero-centred q/k norms, the rotary over a quarter of 256 dims. Against
    a twin that turned the whole head or took the weights as stored, the kernel fails."""
    from dataclasses import replace

    from freetoken.kernels.specs.dense import DecodeAttentionCase, _attention_run
    from freetoken.kernels.triton.decode_attention import decode_attention_reference, qkv_prep_reference

    case = DecodeAttentionCase(batch=2, kv_heads=2, group=8, head_dim=256, key_len=40, splits=0, norm=True,
                               dtype=dtype, seed=11, offset_norm=True, rotary_fraction=0.25)
    spec = REGISTRY["decode_attention"]
    got = spec.kernel(case, DEVICE)
    assert spec.compare(got, spec.twin(case), spec.guarantee) is None
    assert spec.compare(got, spec.twin(replace(case, rotary_fraction=1.0)), spec.guarantee) is not None

    def stored_weights(*args, **kwargs):  # the same inputs, the norm weights taken as stored
        return qkv_prep_reference(*args, **{**kwargs, "offset_norm": False})

    plain = _attention_run(case, "cpu", stored_weights, decode_attention_reference)
    assert spec.compare(got, plain, spec.guarantee) is not None


@pytest.mark.parametrize("variant", ["plain", "once", "offset"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_norm_variant_matches_its_twin(variant: str, dtype: str) -> None:
    """Each family's norm (plain, rounded once, zero-centred weights), alone and after the residual
    add, and the Gated DeltaNet's gated norm, at a model width."""
    from freetoken.kernels.specs.dense import AddNormCase, GatedNormCase, NormCase

    assert check_case("rms_norm", NormCase(3, 2048, dtype, 1.0, 5, variant), DEVICE) is None
    assert check_case("add_rms_norm", AddNormCase(2, 2048, dtype, 6, variant), DEVICE) is None
    assert check_case("gated_rms_norm", GatedNormCase(4, 128, dtype, 7), DEVICE) is None
