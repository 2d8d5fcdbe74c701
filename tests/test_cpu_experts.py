"""The Numba CPU expert kernel against its fp32 twin, its executor, and `bench bw` on CPU.

Guarantee checked for the kernel: max|out - twin| <= 1e-5 * max|twin|, with the twin
`reference.moe.moe_experts` in fp32 on the widened bf16 banks (only the order of fp32 additions
differs). The torch bf16 path rounds x and the activations to bf16: 3e-2 of the scale.
"""

from __future__ import annotations

import argparse
import json
import logging

import numpy as np
import pytest
import torch

from freetoken.bench.bw import add_bench_bw_arguments, run_bench_bw
from freetoken.errors import EngineError
from freetoken.kernels.cpu.bandwidth import physical_cores, read_bandwidth
from freetoken.kernels.cpu.executor import CpuExpertExecutor, Ticket
from freetoken.kernels.cpu.experts import cpu_moe, cpu_moe_torch, cpu_moe_tuned, gate_up_range, group_pairs
from freetoken.moe.bandwidth_profile import DEFAULT_CPU_BPS, DEFAULT_PCIE_BPS, load_ratio
from freetoken.reference.moe import moe_experts
from freetoken.trace import TraceRecorder

TOL = 1e-5


def bf16_bits(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def widen(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy((bits.astype(np.uint32) << 16).view(np.float32))


def make_case(F: int, H: int, I: int, N: int, K: int, seed: int = 0, ids_dtype=np.int32):
    rng = np.random.default_rng(seed)
    w13 = bf16_bits(rng.standard_normal((F, 2 * I, H)) * 0.1)  # [F, 2I, H]
    w2 = bf16_bits(rng.standard_normal((F, H, I)) * 0.1)  # [F, H, I]
    x = rng.standard_normal((N, H)).astype(np.float32)  # [N, H]
    weights = rng.random((N, K)).astype(np.float32)  # [N, K]
    ids = rng.integers(-1, F, (N, K)).astype(ids_dtype)  # [N, K], -1 skipped, repeats likely
    return x, weights, ids, w13, w2


def twin(x, weights, ids, w13, w2) -> np.ndarray:
    return moe_experts(torch.from_numpy(x), torch.from_numpy(weights), torch.from_numpy(ids).long(),
                       widen(w13), widen(w2)).numpy()


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


@pytest.mark.parametrize(
    "F,H,I,N,K",
    [(3, 72, 40, 1, 1), (9, 200, 136, 2, 8), (6, 130, 66, 3, 5), (5, 520, 264, 4, 8)],
)
def test_kernel_matches_twin(F, H, I, N, K):
    x, weights, ids, w13, w2 = make_case(F, H, I, N, K, seed=H)
    out = np.full_like(x, np.nan)  # the kernel must overwrite every element
    cpu_moe(x, weights, ids, w13, w2, out)
    assert rel_err(out, twin(x, weights, ids, w13, w2)) <= TOL


def assert_every_loop_shape(x, weights, ids, w13, w2, ref) -> None:
    """Every blocking the kernel offers (gate rows, down rows, prefetch distance) agrees with `ref`."""
    for gate_rows in (1, 2, 4):
        for down_rows in (2, 4, 8):
            for prefetch in (0, 600):
                out = np.full_like(x, np.nan)
                cpu_moe_tuned(x, weights, ids, w13, w2, out, gate_rows, down_rows, prefetch)
                assert rel_err(out, ref) <= TOL, (gate_rows, down_rows, prefetch)


def test_every_loop_shape_and_int64_ids():
    # H and I above the 256-element prefetch block, with tails; 8 routes over 5 experts repeat.
    x, weights, ids, w13, w2 = make_case(5, 530, 270, 3, 8, seed=1, ids_dtype=np.int64)
    ref = twin(x, weights, ids, w13, w2)
    assert_every_loop_shape(x, weights, ids, w13, w2, ref)


def test_repeated_expert_within_a_token_and_across_tokens():
    x, weights, _, w13, w2 = make_case(4, 96, 48, 3, 4, seed=2)
    ids = np.array([[2, 2, -1, 0], [2, 0, 0, 2], [-1, -1, -1, 2]], np.int32)
    out = np.empty_like(x)
    cpu_moe(x, weights, ids, w13, w2, out)
    assert rel_err(out, twin(x, weights, ids, w13, w2)) <= TOL


def test_all_routes_elsewhere_gives_zeros():
    x, weights, _, w13, w2 = make_case(3, 72, 40, 2, 4)
    out = np.full_like(x, 7.0)
    cpu_moe(x, weights, np.full((2, 4), -1, np.int32), w13, w2, out)
    assert not out.any()


def test_nan_in_activations_comes_out_as_nan():
    # fastmath without nnan: a NaN is not optimised away.
    x, weights, _, w13, w2 = make_case(3, 72, 40, 2, 2)
    x[1, 5] = np.nan
    out = np.empty_like(x)
    cpu_moe(x, weights, np.array([[0, 1], [1, 2]], np.int32), w13, w2, out)
    assert np.isfinite(out[0]).all() and np.isnan(out[1]).all()


def test_bad_ids_and_shapes_raise():
    x, weights, ids, w13, w2 = make_case(3, 72, 40, 2, 4)
    out = np.empty_like(x)
    with pytest.raises(ValueError, match="out of range"):
        cpu_moe(x, weights, np.full((2, 4), 3, np.int32), w13, w2, out)
    with pytest.raises(ValueError, match="shape mismatch"):
        cpu_moe(x[:, :-1].copy(), weights, ids, w13, w2, out)


def test_torch_path_agrees_within_bf16_rounding():
    x, weights, ids, w13, w2 = make_case(6, 130, 66, 3, 5, seed=3)
    out = np.empty_like(x)
    cpu_moe_torch(x, weights, ids, w13, w2, out)
    assert rel_err(out, twin(x, weights, ids, w13, w2)) <= 3e-2


def test_group_pairs_orders_pairs_by_fid():
    ids = np.array([[4, 2, -1], [2, 4, 1]], np.int32)
    weights = np.arange(6, dtype=np.float32).reshape(2, 3)
    fids, starts, pair_n, pair_w = group_pairs(weights, ids)
    assert fids.tolist() == [1, 2, 4] and starts.tolist() == [0, 1, 3, 5]
    assert pair_n.tolist() == [1, 0, 1, 0, 1] and pair_w.tolist() == [5, 1, 3, 0, 4]


def test_gate_up_range_writes_only_its_range_of_i():
    """The pollers' team computes phase 1 a block of I at a time: a range writes its own
    activations and leaves the rest as they were."""
    F, H, I, N, K = 3, 72, 96, 2, 2
    x, weights, _, w13, w2 = make_case(F, H, I, N, K)
    ids = np.array([[1, 2], [-1, 1]], np.int32)
    fids, starts, pair_n, _ = group_pairs(weights, ids)
    act = np.full((3, I), 7.0, np.float32)  # [P, I]
    for u in range(2):
        gate_up_range(u, 32, 64, fids, starts, pair_n, x, w13, act, 4, 4 * H)
    assert (act[:, 32:64] != 7).all() and (act[:, :32] == 7).all() and (act[:, 64:] == 7).all()


def test_out_of_range_ids_raise():
    F, H, I, N, K = 3, 72, 64, 2, 2
    x, weights, ids, w13, w2 = make_case(F, H, I, N, K)
    ok = np.array([[2, -1], [0, 1]], np.int64)
    out = np.empty_like(x)
    cpu_moe(x, weights, ok, w13, w2, out)
    for bad in (3,  # fid past the banks
                1 << 20,  # far past them
                (1 << 40) + 1,  # int64 only
                -2):
        for dtype in (np.int32, np.int64):
            if np.iinfo(dtype).max < bad:
                continue
            ids = ok.astype(dtype)
            ids[1, 1] = bad
            for fn in (cpu_moe, cpu_moe_torch):
                with pytest.raises(ValueError, match="expert id out of range"):
                    fn(x, weights, ids, w13, w2, out)


def test_executor_submit_wait_and_trace():
    x, weights, ids, w13, w2 = make_case(6, 130, 66, 3, 5, seed=4)
    rec = TraceRecorder()
    with CpuExpertExecutor(w13, w2, threads=2, recorder=rec) as ex:
        outs = [np.empty_like(x) for _ in range(3)]
        tickets = [ex.submit(x, weights, ids, o) for o in outs]  # several in flight
        results = [t.wait(timeout=120) for t in tickets]
    ref = twin(x, weights, ids, w13, w2)
    for t, o, r in zip(tickets, outs, results, strict=True):
        assert r is o and t.done()
        assert rel_err(o, ref) <= TOL
    spans = [e for e in rec.to_chrome()["traceEvents"] if e.get("ph") == "X"]
    assert [e["name"] for e in spans] == ["cpu_moe"] * 3


def test_executor_kernel_failure_fails_the_ticket_not_the_worker():
    x, weights, ids, w13, w2 = make_case(3, 72, 40, 2, 4, seed=5)
    with CpuExpertExecutor(w13, w2, threads=1) as ex:
        bad = ex.submit(x, weights, np.full_like(ids, 99), np.empty_like(x))
        with pytest.raises(ValueError, match="out of range"):
            bad.wait(timeout=120)
        with pytest.raises(ValueError, match="out of range"):  # a second wait says the same
            bad.wait(timeout=0)
        good = ex.submit(x, weights, ids, np.empty_like(x))  # the worker lives on
        assert rel_err(good.wait(timeout=120), twin(x, weights, ids, w13, w2)) <= TOL
    with pytest.raises(EngineError, match="stopped"):
        ex.submit(x, weights, ids, np.empty_like(x))
    with CpuExpertExecutor(w13, w2, threads=1) as ex, pytest.raises(ValueError, match="dtypes"):
        ex.submit(x.astype(np.float64), weights, ids, np.empty_like(x))


def test_ticket_wait_timeout_raises_engine_error():
    never = Ticket(np.empty(1, np.float32))  # nothing will ever ring it
    with pytest.raises(EngineError, match="no result within"):
        never.wait(timeout=0.01)
    assert not never.done()


def test_probes():
    assert 1 <= physical_cores()
    assert read_bandwidth(1 << 20, threads=1, repeats=1) > 0


def test_bench_bw_on_cpu_writes_a_profile_load_ratio_reads(tmp_path):
    path = tmp_path / "profiles.json"
    parser = argparse.ArgumentParser()
    add_bench_bw_arguments(parser)
    args = parser.parse_args(["--hidden", "96", "--intermediate", "40", "--top-k", "4", "--experts", "8",
                              "--repeats", "3", "--read-mib", "4", "--threads", "2", "--out", str(path)])
    assert run_bench_bw(args) == 0
    profiles = json.loads(path.read_text())
    (gpu,) = profiles
    prof = profiles[gpu]["bf16"]
    assert prof["cpu_expert_Bps"] > 0 and prof["cpu_read_Bps"] > 0
    assert prof["shape"]["expert_bytes"] == 3 * 96 * 40 * 2
    assert "--hidden 96" in prof["command"]
    pcie, cpu, source = load_ratio(path, gpu, "bf16")
    if prof["concurrent"]:  # a CUDA machine measured both at once
        assert (pcie, cpu) == (prof["concurrent"]["pcie_fill_Bps"], prof["concurrent"]["cpu_expert_Bps"])
        assert source.startswith("concurrent pair")
    else:
        assert (pcie, cpu) == (DEFAULT_PCIE_BPS, prof["cpu_expert_Bps"])
        assert "PCIe default" in source and str(path) in source


def test_load_ratio_without_profile_warns_and_uses_stated_defaults(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="freetoken.moe.bandwidth_profile"):
        pcie, cpu, source = load_ratio(tmp_path / "missing.json", "NVIDIA H200", "bf16")
    assert (pcie, cpu) == (DEFAULT_PCIE_BPS, DEFAULT_CPU_BPS)
    assert source.startswith("defaults") and "25 GB/s" in source and "50 GB/s" in source
    assert "bench bw" in caplog.text
