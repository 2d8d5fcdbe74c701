"""`--moe-policy auto` in CUDA graphs: one captured graph serves every mode (it reads the share
when it runs), and each step does what its mode's policy does: a transfer step routes nothing to
the CPU, a cpu step fetches nothing."""

from __future__ import annotations

import pytest

from freetoken.config import EngineConfig, MoeConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.loader.synth import write_synthetic_checkpoint
from freetoken.moe import live_policy
from freetoken.reference.policy_choice import ChoiceParams

PARAMS = ChoiceParams(warmup=2, settle=1, measure=3, patience=8, period=30, window=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("m") / "qwen3", "qwen3_moe", "tiny", seed=3)


@pytest.mark.parametrize("adaptive", [False, True])
def test_one_graph_serves_every_mode_and_each_step_does_its_modes_work(model_dir, adaptive, monkeypatch):
    monkeypatch.setattr(live_policy, "ChoiceParams", lambda: PARAMS)
    config = EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", max_model_len=256,
                          moe=MoeConfig(policy="auto", cache_slots=5, params={"adaptive": str(adaptive).lower()}))
    runner = ModelRunner(str(model_dir), config, rows=1)
    assert runner.live_choice is not None and runner.graphs is not None
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    last, pos = int(runner.prefill(runner.row_pages(0), prompt)[0].argmax()), len(prompt)
    seen = {"hybrid": 0, "transfer": 0, "cpu": 0}
    before = runner.status()
    for step in range(70):
        # vary the tokens so that the tiny cache keeps missing
        logits = runner.decode([runner.row_pages(0)], [(last + step * 7) % 300], [pos])
        last, pos = int(logits[0].argmax()), pos + 1
        ran = runner.live_choice.mode  # (set at the step's start; the next step's start may change it)
        status = runner.status()
        seen[ran] += 1
        fetched = status["experts_fetched"] - before["experts_fetched"]
        cpu_routes = status["cpu_routes"] - before["cpu_routes"]
        if ran == "transfer":
            assert cpu_routes == 0, step
        if ran == "cpu":
            assert fetched == 0, step
        before = status
    assert all(seen.values()), seen
    graphs = runner.status()["decode_graphs"]
    assert graphs["captured"] == [[1, 128]] and graphs["capture_failures"] == 0 and graphs["eager_shapes"] == []
    runner.close()
