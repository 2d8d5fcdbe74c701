"""What the host reads back each decode step without the copy engine: the sampled tokens
(engine/host_readback.py) and the graph plane's counters and stamps through their pinned mirror
(engine/graph_plane.py), equal to what a copy reads; and a live split in graphs that takes its
samples and folds its counters from the mirror, step by step."""

from __future__ import annotations

import pytest
import torch

from freetoken.cache.slot_cache import STAT_FIELDS, CacheStats
from freetoken.config import EngineConfig, MoeConfig
from freetoken.engine.graph_plane import LAYER_POINTS, GraphPlane
from freetoken.engine.host_readback import HostReadback
from freetoken.engine.model_runner import ModelRunner
from freetoken.loader.synth import write_synthetic_checkpoint
from freetoken.moe.policy import params_for


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.bfloat16])
def test_readback_equals_a_copy_after_the_work_that_makes_it(dtype):
    readback = HostReadback()
    for n in (1, 3, 130, 5000):  # (the buffer grows; smaller reads reuse it)
        x = torch.arange(n, device="cuda").to(dtype)
        x.mul_(3)  # queued work the read must wait for
        assert readback.read(x) == x.cpu().tolist()
    y = torch.arange(12, device="cuda", dtype=torch.int64).view(3, 4)
    assert readback.read(y.t()) == y.t().cpu().tolist()  # (non-contiguous: read in its shape)


def test_plane_mirror_carries_counts_and_stamps():
    plane = GraphPlane(3, "cuda")
    plane.enable_stamps()
    plane.counts.copy_(torch.arange(3 * len(STAT_FIELDS), device="cuda").view(3, -1))
    plane.stamps.fill_(7)
    plane.mirror()
    assert plane.host_counts() == plane.counts.cpu().tolist()
    assert plane.host_stamps() == [[7] * len(LAYER_POINTS)] * 3
    stats = CacheStats.zeros(3)
    gained = plane.fold_into(stats)
    assert gained == [sum(col) for col in zip(*plane.counts.cpu().tolist(), strict=True)]
    plane.counts[1, 0] += 5  # not mirrored yet: the fold sees nothing new
    assert plane.fold_into(stats) == [0] * len(STAT_FIELDS)
    plane.mirror()
    assert plane.fold_into(stats)[0] == 5


def test_live_split_in_graphs_folds_every_step_from_the_mirror(tmp_path):
    model_dir = write_synthetic_checkpoint(tmp_path / "qwen3", "qwen3_moe", "tiny", seed=3)
    config = EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", max_model_len=256,
                          moe=MoeConfig(policy="hybrid", cache_slots=10,
                                        params=params_for("hybrid", {"adaptive": True})))
    runner = ModelRunner(str(model_dir), config, rows=1)
    try:
        assert runner.graphs is not None and runner.live_split is not None
        row = runner.row_pages(0)
        last = int(runner.prefill(row, [3, 1, 4, 1, 5])[0].argmax())
        runner.sync_stats()
        before = sum(runner.slots.stats.hits) + sum(runner.slots.stats.misses)
        steps = 12
        for i in range(steps):
            last = int(runner.decode([row], [last], [5 + i])[0].argmax())
        runner.sync_stats()
        looked_up = sum(runner.slots.stats.hits) + sum(runner.slots.stats.misses) - before
        cfg = runner.model_config
        assert looked_up == steps * cfg.top_k * cfg.num_sparse_layers  # every step's routes, once
        assert runner.graphs.plane.host_counts() == runner.graphs.plane.counts.cpu().tolist()
        assert runner.live_split.state.step == steps
    finally:
        runner.close()


def test_sampler_on_cuda_mixes_greedy_seeded_and_failed_rows():
    """Sampled rows draw on the device and the batch is read once: a NaN row gets -1 and its
    error, a greedy row its argmax, seeded rows the same tokens again with fresh generators."""
    from freetoken.config import SamplingParams
    from freetoken.engine.sampler import Sampler

    logits = torch.randn(4, 50, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    logits[1, 7] = float("nan")
    params = [SamplingParams(temperature=0.8, seed=5), SamplingParams(temperature=0.7, seed=6),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=9)]

    def draw():
        sampler = Sampler("cuda", seed=1)
        return sampler.sample(logits, params, [sampler.generator_for(p) for p in params])

    first, again = draw(), draw()
    assert first[1].token == -1 and first[1].error
    assert first[2].token == int(logits[2].argmax())
    assert [s.token for s in first] == [s.token for s in again]
    assert 0 <= first[0].token < 50 and first[3].token in torch.topk(logits[3], 5).indices.tolist()
