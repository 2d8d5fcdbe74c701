"""The graph plane's counters and stamps read through their pinned mirror (engine/graph_plane.py),
equal to what a copy reads; and captured steps whose live split and auto choice fold their
counters from the mirror, step by step, counting every route once."""

from __future__ import annotations

import pytest
import torch

from freetoken.cache.slot_cache import STAT_FIELDS, CacheStats
from freetoken.config import EngineConfig, MoeConfig
from freetoken.engine.graph_plane import LAYER_POINTS, GraphPlane
from freetoken.engine.model_runner import ModelRunner
from freetoken.loader.synth import write_synthetic_checkpoint
from freetoken.moe.policy import params_for


def test_plane_mirror_carries_counts_and_stamps():
    plane = GraphPlane(3, "cuda")
    plane.enable_stamps()
    plane.counts.copy_(torch.arange(3 * len(STAT_FIELDS), device="cuda").view(3, -1))
    plane.stamps.fill_(7)
    plane.mirror()
    torch.cuda.synchronize()
    assert plane.host_counts() == plane.counts.cpu().tolist()
    assert plane.host_stamps() == [[7] * len(LAYER_POINTS)] * 3
    stats = CacheStats.zeros(3)
    gained = plane.fold_into(stats, plane.host_counts())
    assert gained == [sum(col) for col in zip(*plane.counts.cpu().tolist(), strict=True)]
    plane.counts[1, 0] += 5  # not mirrored yet: a fold of the mirror sees nothing new
    assert plane.fold_into(stats, plane.host_counts()) == [0] * len(STAT_FIELDS)
    plane.mirror()
    torch.cuda.synchronize()
    assert plane.fold_into(stats, plane.host_counts())[0] == 5


@pytest.mark.parametrize("policy, params", [("hybrid", {"adaptive": True}), ("auto", {})])
def test_live_steps_in_graphs_fold_every_route_once_from_the_mirror(tmp_path, policy, params):
    model_dir = write_synthetic_checkpoint(tmp_path / "qwen3", "qwen3_moe", "tiny", seed=3)
    config = EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", max_model_len=256,
                          moe=MoeConfig(policy=policy, cache_slots=10, params=params_for(policy, params)))
    runner = ModelRunner(str(model_dir), config, rows=1)
    try:
        assert runner.graphs is not None
        row = runner.row_pages(0)
        last = int(runner.prefill(row, [3, 1, 4, 1, 5])[0].argmax())
        runner.sync_stats()
        before = sum(runner.slots.stats.hits) + sum(runner.slots.stats.misses)
        steps = 12
        for i in range(steps):  # (decode tells the live split or auto each step's start and end)
            last = int(runner.decode([row], [last], [5 + i])[0].argmax())
        runner.sync_stats()
        looked_up = sum(runner.slots.stats.hits) + sum(runner.slots.stats.misses) - before
        cfg = runner.model_config
        assert looked_up == steps * cfg.top_k * cfg.num_sparse_layers  # every step's routes, once
        assert runner.graphs.plane.host_counts() == runner.graphs.plane.counts.cpu().tolist()
        if runner.live_split is not None:
            assert runner.live_split.state.step == steps
            assert runner.graphs.plane.stamp_points == {"posted", "filled"}  # (no trace: the fill's two)
            assert runner.model.backend.live.pcie_fill.total > 0  # fills timed over their stamps
    finally:
        runner.close()
