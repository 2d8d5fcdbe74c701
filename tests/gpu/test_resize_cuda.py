"""Live resize on CUDA: device memory committed and given back in place (the driver's virtual
memory management), and an engine whose caches hold all the free memory resizing between
captured decode steps with the tokens of a run without resizes."""

from __future__ import annotations

import pytest
import torch

from freetoken.cache.resizable_rows import ResizableRows
from freetoken.config import EngineConfig, KvConfig, MoeConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.loader.synth import write_synthetic_checkpoint
from freetoken.moe.policy import params_for

MiB = 1 << 20
pytestmark = pytest.mark.device_memory  # (conftest.py: parallel workers would move the free memory it checks)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("m") / "qwen3", "qwen3_moe", "tiny", seed=5)


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_rows_commit_only_what_they_hold_and_give_the_rest_back():
    bank = ResizableRows(1, 4096, (1024, 1024), torch.bfloat16, "cuda", rows=16)  # 2 MiB rows
    address = bank.tensor.data_ptr()
    bank.tensor.normal_()
    kept = bank.tensor[0, :8].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = bank.tensor[0, 3] * 2
    before = _free()
    bank.resize(1040)  # +2 GiB
    grown = _free()
    assert before - grown >= 2000 * MiB and bank.tensor.data_ptr() == address
    assert torch.equal(bank.tensor[0, :8], kept) and not bank.tensor[0, 16:].any()
    graph.replay()  # the captured address still holds the same row
    assert torch.equal(y, kept[3] * 2)
    bank.resize(8)
    assert _free() - grown >= 2000 * MiB + 16 * MiB  # given back to the device, not kept
    assert torch.equal(bank.tensor[0], kept) and bank.tensor.data_ptr() == address
    free = _free()
    total = torch.cuda.get_device_properties(0).total_memory
    huge = ResizableRows(1, total // (4 * MiB) + 64, (2 * MiB,), torch.bfloat16, "cuda")
    with pytest.raises(torch.OutOfMemoryError):
        huge.resize(huge.max_rows)  # more than the device has: refused as a whole
    assert huge.rows == 0 and abs(_free() - free) < 64 * MiB


def _decode(runner: ModelRunner, steps: int, resizes: dict[int, tuple[int, int]]) -> tuple[list[int], list[dict]]:
    pages = list(range(16))  # 256 positions, below every pool size used here
    tokens = [int(runner.prefill(pages, [3, 1, 4, 1, 5, 9, 2, 6])[0].argmax())]
    statuses = []
    for step in range(steps):
        if step in resizes:
            free = _free()
            slots, kv_pages = resizes[step]
            runner.resize(slots, kv_pages, {p: p for p in pages})
            statuses.append({"free_before": free, "free_after": _free(), **runner.status()})
        logits = runner.decode([pages], [tokens[-1]], [8 + step])
        tokens.append(int(logits[0].argmax()))
    return tokens, statuses


@pytest.mark.parametrize("policy", ["transfer", "hybrid"])
def test_caches_holding_all_free_memory_resize_in_place_between_captured_steps(model_dir, policy):
    """The default budget (no slot count: every expert the free memory holds) and a KV pool of
    4 GiB; then the device is filled but for the headroom and 64 MiB. Halving the KV pool fits
    only in place (a second pool beside it would need 2 GiB), and its memory is really given
    back; growing again takes it. (The pool commits memory in pieces of about 1/512 of the
    device's memory a layer, so a pool of a few hundred MiB on a large device is one piece a
    layer and a halving gives nothing back.) `transfer` computes every expert on the device, so its
    tokens equal those of the same steps without resizes; `hybrid` moves experts to the CPU as
    the cache shrinks (the same tokens only up to the summation order), so it is held to
    completing every step with the sizes asked for."""
    config = EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", max_model_len=256,
                          moe=MoeConfig(policy=policy, params=params_for(policy, {"ratio": 0.5})),
                          kv=KvConfig(tokens=1 << 23))  # 512 B a token: 4 GiB
    runner = ModelRunner(str(model_dir), config, rows=1)
    assert runner.graphs is not None
    expected, _ = _decode(runner, 24, {})
    runner.close()
    del runner
    torch.cuda.empty_cache()

    runner = ModelRunner(str(model_dir), config, rows=1)
    pool = runner.report.pool_experts
    assert runner.slots.num_slots == pool
    pages = runner.cache.num_pages
    ballast = torch.empty(_free() - runner.headroom_bytes - 64 * MiB, dtype=torch.uint8, device="cuda")
    try:
        tokens, statuses = _decode(runner, 24, {4: (pool // 4, pages // 2), 10: (pool, pages),
                                                16: (2, pages // 4)})
        graphs = runner.status()["decode_graphs"]
        captured = graphs["captured"]
    finally:
        del ballast
        runner.close()
        torch.cuda.empty_cache()  # the ballast back to the driver, not kept by torch's allocator
    halved, regrown, quartered = statuses
    assert halved["expert_slots"] == pool // 4 and halved["kv_pages"] == pages // 2
    assert halved["free_after"] - halved["free_before"] >= 1024 * MiB  # most of the KV half given back
    assert regrown["kv_pages"] == pages and regrown["kv_bytes"] == 2 * halved["kv_bytes"]
    assert quartered["expert_slots"] == 2 and quartered["kv_pages"] == pages // 4
    assert captured and len(tokens) == len(expected)  # the last size's steps were captured again
    assert graphs["capture_failures"] == 0  # every shape after every resize captured, none ran eagerly
    if policy == "transfer":
        assert tokens == expected
