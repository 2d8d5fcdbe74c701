"""benchmarks/decode_cost_model.py prices the engine's own plans: its counts are the simulator's."""

from __future__ import annotations

import json

from benchmarks.decode_cost_model import Costs, main, model
from freetoken.sim.simulate import simulate, trace_plans
from freetoken.sim.synthetic import SyntheticConfig, generate, write_trace


def test_counts_are_the_engine_plans_and_the_per_call_split_prices_the_call(tmp_path):
    ids = generate(SyntheticConfig(4, 16, 4, 120, skew=0.5, reuse=0.3, window=2, seed=1))
    trace = tmp_path / "trace.jsonl"
    write_trace(ids, trace)
    plans, _ = trace_plans(str(trace), 4, 16, False)
    for policy, kwargs in (("hybrid", {"background_fills": False}), ("transfer", {}), ("static", {}),
                           ("hybrid-background", {}), ("hybrid-qstar-alone", {"fetch_recurring": False})):
        got = model(plans, 4, 16, 24, policy, 0.473, Costs(), warmup_tokens=20)
        want = simulate(str(trace), 4, 16, 24, policy.split("-")[0], ratio=0.473, warmup_tokens=20, **kwargs)
        assert abs(got["hit_rate"] - want.hit_rate) < 1e-12, policy
        assert abs(got["cpu_experts_per_token"] - want.cpu_experts_per_token) < 1e-9, policy
    # one miss: a CPU call dearer than a fetch sends it over PCIe; a free call with cheap experts keeps it
    assert Costs().per_call_fetches(1) == 1
    assert Costs(cpu_call_us=0, cpu_expert_us=100, fetch_us=250).per_call_fetches(1) == 0
    assert Costs(cpu_call_us=0, cpu_expert_us=100, fetch_us=250).per_call_fetches(7) == 2  # 2*250 vs 5*100
    out = tmp_path / "model.json"
    assert main(["--trace", str(trace), "--num-layers", "4", "--num-experts", "16", "--cache-slots", "24",
                 "--warmup-tokens", "20", "--out", str(out)]) == 0
    assert [r["policy"] for r in json.loads(out.read_text())["results"]] == [
        "transfer", "cpu", "static", "hybrid", "hybrid-background", "hybrid-qstar-alone", "hybrid-lone", "per-call"]
    # lone misses fetched: never more CPU experts than hybrid; the hand-off's cost charges every
    # layer of a CPU-branch policy and none of transfer's
    lone = model(plans, 4, 16, 24, "hybrid-lone", 0.473, Costs(), warmup_tokens=20)
    hybrid = model(plans, 4, 16, 24, "hybrid", 0.473, Costs(), warmup_tokens=20)
    assert lone["cpu_experts_per_token"] <= hybrid["cpu_experts_per_token"]
    taxed = Costs(branch_us=50.0)
    for policy in ("transfer", "hybrid"):
        plain, dear = (model(plans, 4, 16, 24, policy, 0.473, c, warmup_tokens=20) for c in (Costs(), taxed))
        steps = 1 / plain["tok_per_s"], 1 / dear["tok_per_s"]
        assert (abs(steps[1] - steps[0] - 4 * 50e-6) < 1e-9) == (policy == "hybrid"), policy
    # each background fill costs its step `background_us`, and nothing else changes
    free, dear = (model(plans, 4, 16, 24, "hybrid-background", 0.473, Costs(background_us=b), warmup_tokens=20)
                  for b in (0.0, 30.0))
    assert dear["tok_per_s"] < free["tok_per_s"] and dear["hit_rate"] == free["hit_rate"]
