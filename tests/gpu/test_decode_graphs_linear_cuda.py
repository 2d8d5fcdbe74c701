"""Captured decode steps of a linear-attention model (tiny qwen3_5_moe, bf16): the Gated DeltaNet
layers' conv and delta-rule kernels, the gated attention and the shared expert inside the graph,
against the same steps run eagerly.

Checked: greedy tokens equal eager ones under every policy, at batch 1 and at batch 3 run in the
batch-4 graph (one padding row, whose state slot is read-only), across key buckets; the
recurrent-state pool after the steps equals the eager one's.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig, GraphConfig, MoeConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.loader.synth import write_synthetic_checkpoint
from freetoken.moe.policy import POLICIES, params_for

PROMPTS = [[5, 9, 300, 12, 7, 7, 81, 64], [40, 41, 42], [200, 199, 198, 197, 196]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("m") / "q35", "qwen3_5_moe", "tiny", seed=7)


def _runner(model_dir, policy, eager, batch, batch_sizes=None) -> ModelRunner:
    slots = None if policy == "resident" else 10
    config = EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", max_model_len=320,
                          moe=MoeConfig(policy=policy, cache_slots=slots, params=params_for(policy, {"ratio": 0.5})),
                          graphs=GraphConfig(eager=eager, batch_sizes=batch_sizes))
    runner = ModelRunner(str(model_dir), config, rows=max(batch, *(batch_sizes or [1])))
    assert (runner.graphs is None) == eager
    return runner


def greedy(model_dir, policy, eager, batch=1, steps=24, batch_sizes=None):
    runner = _runner(model_dir, policy, eager, batch, batch_sizes)
    slots = [runner.states.acquire() for _ in range(batch)][::-1]  # (not in row order)
    last = [int(runner.prefill(runner.row_pages(r), PROMPTS[r], state_slot=slots[r])[0].argmax())
            for r in range(batch)]
    pos = [len(p) for p in PROMPTS[:batch]]
    out = [[t] for t in last]
    for _ in range(steps):
        last = runner.decode([runner.row_pages(r) for r in range(batch)], last, pos, slots).argmax(-1).tolist()
        pos = [q + 1 for q in pos]
        for r, t in enumerate(last):
            out[r].append(t)
    state = (runner.states.conv.float().cpu(), runner.states.ssm.cpu())
    status = runner.status()
    runner.close()
    return out, state, status


@pytest.mark.parametrize("policy", list(POLICIES))
def test_graph_tokens_equal_eager_tokens(model_dir, policy):
    eager, eager_state, _ = greedy(model_dir, policy, eager=True)
    graph, graph_state, status = greedy(model_dir, policy, eager=False)
    assert graph == eager
    assert status["decode_graphs"]["captured"] == [[1, 128]]
    for got, want in zip(graph_state, eager_state, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_padded_batch_keeps_every_sequences_state(model_dir):
    # batch 3 in the batch-4 graph: the padding row repeats row 0 without writing its state twice;
    # 150 steps cross the 128 and 256 key buckets
    eager, eager_state, _ = greedy(model_dir, "hybrid", eager=True, batch=3, steps=150)
    graph, graph_state, status = greedy(model_dir, "hybrid", eager=False, batch=3, steps=150, batch_sizes=[1, 4])
    assert graph == eager
    assert sorted(map(tuple, status["decode_graphs"]["captured"])) == [(4, 128), (4, 256)]
    for got, want in zip(graph_state, eager_state, strict=True):  # (the graph runner has a fourth slot, unused)
        torch.testing.assert_close(got[:, :3], want, rtol=2**-7, atol=1e-3)
        assert (got[:, 3] == 0).all()

