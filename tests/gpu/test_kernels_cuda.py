"""The kernel registry on CUDA, the bf16 helper against the hardware cast, and graph capture.

Skipped without CUDA (tests/gpu/conftest.py). Run with TRITON_INTERPRET unset.
"""

from __future__ import annotations

import random

import pytest
import torch

from freetoken.kernels.registry import check_case, check_kernel
from freetoken.kernels.specs import load_all_specs
from freetoken.kernels.specs.plan import PlanCase
from freetoken.reference.expert_cache import CacheState, plan_layer
from freetoken.reference.fetch_rule import FetchRule

REGISTRY = load_all_specs()


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_kernel_matches_twin_on_cuda(name: str) -> None:
    report = check_kernel(name, "cuda", max_examples=3 * REGISTRY[name].max_examples)
    assert report.passed, report.summary()


def test_rne_helper_equals_hardware_cast() -> None:
    from freetoken.kernels.triton.rounding import round_to_bf16

    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    ties = (torch.arange(1 << 16, dtype=torch.int32) << 16) | 0x8000  # exactly halfway, every high half
    x = torch.cat([bits, ties, ties - 1, ties + 1]).view(torch.float32).cuda()
    got, want = round_to_bf16(x), x.to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def test_plan_at_full_scale() -> None:
    """48 layers x 128 experts, 37% of them in slots, batch 8 x top-8: BLOCK_S = 4096, BLOCK_P = 64."""
    rng = random.Random(0)
    steps = tuple((rng.randrange(48), tuple(tuple(rng.sample(range(128), 8)) for _ in range(8)),
                   rng.choice([FetchRule.QSTAR_RECURRING, FetchRule.ALL]), 30000) for _ in range(96))
    assert check_case("plan", PlanCase(48, 128, 2273, (), 0, steps, tally=True), "cuda") is None  # as captured
    steps = tuple((layer, ids, FetchRule.ALL, 0) for layer, ids, _, _ in steps[:24])  # S = L*E: BLOCK_S = 8192
    assert check_case("plan", PlanCase(48, 128, 6144, (), 0, steps), "cuda") is None


@pytest.mark.parametrize("live_ratio", [False, True], ids=["ratio-baked", "ratio-live"])
def test_plan_and_fill_replay_in_a_cuda_graph(live_ratio: bool) -> None:
    """No host synchronisation inside: both launches capture, and replays follow the twin. With
    the ratio in a device word (as the slot cache passes it), each replay plans with the value
    written there last, not the one at capture."""
    from freetoken.kernels.device_cache_state import DeviceCacheState
    from freetoken.kernels.triton.plan import plan_layer_device
    from freetoken.kernels.triton.slot_fill import fill_slots
    from freetoken.reference.fetch_rule import FetchRule

    L, E, S, N, K, ratio = 2, 16, 12, 2, 4, 40000
    word = torch.full((1,), ratio, dtype=torch.int32, device="cuda")
    host = torch.randn(L * E, 8, 32).to(torch.bfloat16).pin_memory()  # [L*E, ...]
    slots = torch.zeros(S, 8, 32, dtype=torch.bfloat16, device="cuda")  # [S, ...]
    ref = CacheState(L, E, S)
    state = DeviceCacheState.from_reference(ref, "cuda")
    ids = torch.zeros(N, K, dtype=torch.int32, device="cuda")
    layer = 1
    torch.cuda.synchronize()
    for _ in range(2):  # compile outside the capture, then undo its effect on the state
        plan_layer_device(state, layer, ids, FetchRule.QSTAR_RECURRING, ratio)
    state = DeviceCacheState.from_reference(ref, "cuda")
    fill_slots(torch.full((N * K,), -1, dtype=torch.int32, device="cuda"), torch.full((N * K,), -1,
               dtype=torch.int32, device="cuda"), [host], [slots])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = plan_layer_device(state, layer, ids, FetchRule.QSTAR_RECURRING, word if live_ratio else ratio)
        fill_slots(plan.copy_slots, plan.copy_fids, [host], [slots])
    rng = random.Random(1)
    for _ in range(40):
        rows = [rng.sample(range(E), K) for _ in range(N)]
        ids.copy_(torch.tensor(rows, dtype=torch.int32))
        if live_ratio:
            ratio = rng.choice([0, 1, 9000, 32768, 65535, 65536])
            word.fill_(ratio)
        graph.replay()
        want = plan_layer(ref, layer, rows, FetchRule.QSTAR_RECURRING, ratio)
        assert plan.routes.tolist() == want.routes
        assert state.to_reference() == ref
        for slot, fid in want.copies:
            assert torch.equal(slots[slot].cpu(), host[fid])


def test_device_stamps_follow_stream_order_and_map_onto_the_host_clock() -> None:
    import time

    from freetoken.kernels.triton.device_clock import DeviceClock, stamp

    clock = DeviceClock.calibrate()
    buf = torch.zeros(8, dtype=torch.int64, device="cuda")
    before = time.perf_counter_ns()
    stamp(buf, 0)
    torch.cuda._sleep(1_000_000)  # ~0.5 ms of GPU cycles between the stamps
    stamp(buf, 1, count=3)
    torch.cuda.synchronize()
    after = time.perf_counter_ns()
    t = buf.tolist()
    assert t[1] == t[2] == t[3] and t[1] - t[0] > 100_000 and t[4:] == [0] * 4
    slack = clock.uncertainty_ns + 50_000
    assert before - slack <= clock.to_host_ns(t[0]) <= clock.to_host_ns(t[1]) <= after + slack


@pytest.mark.parametrize("banks", [2, 4], ids=["one-launch", "two-launches"])
def test_the_slot_fill_stamps_its_own_start_and_end(banks: int) -> None:
    """The fill times itself (what the live split samples every captured step): the copies are
    the unstamped fill's, its start and end lie between stamps launched around it, a fill of a
    few experts takes time, and a later fill's stamps (no reset between) are later still."""
    from freetoken.kernels.triton.device_clock import stamp
    from freetoken.kernels.triton.slot_fill import fill_slots

    E, S = 8, 6
    host = [torch.randn(E, 64, 1024).to(torch.bfloat16).pin_memory() for _ in range(banks)]
    slots = [torch.zeros(S, 64, 1024, dtype=torch.bfloat16, device="cuda") for _ in range(banks)]
    copy_slots = torch.tensor([0, 3, -1, 5], dtype=torch.int32, device="cuda")
    copy_fids = torch.tensor([2, 7, 1, 0], dtype=torch.int32, device="cuda")
    stamps = torch.zeros(2, dtype=torch.int64, device="cuda")
    around = torch.zeros(4, dtype=torch.int64, device="cuda")
    fill_slots(copy_slots, copy_fids, host, slots)  # compile outside the timed runs
    with pytest.raises(ValueError, match="stamps must be a contiguous"):
        fill_slots(copy_slots, copy_fids, host, slots, stamps=torch.zeros(3, dtype=torch.int64, device="cuda"))
    ends = []
    for run in range(2):
        for bank in slots:
            bank.zero_()
        stamp(around, 2 * run)
        fill_slots(copy_slots, copy_fids, host, slots, stamps=stamps)
        stamp(around, 2 * run + 1)
        torch.cuda.synchronize()
        start, end = stamps.tolist()
        before, after = around.tolist()[2 * run : 2 * run + 2]
        assert before <= start < end <= after, (before, start, end, after)
        assert all(start > earlier for earlier in ends)
        ends.append(end)
        for slot, fid in ((0, 2), (3, 7), (5, 0)):
            for h, s in zip(host, slots, strict=True):
                assert torch.equal(s[slot].cpu(), h[fid])
        assert not any(bank[[1, 2, 4]].any() for bank in slots)  # the -1 entry copied nothing
