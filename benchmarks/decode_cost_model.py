"""A time model of decode under each policy, driven by a routing trace: which split to try next.

    python -m benchmarks.decode_cost_model --trace benchmarks/results/own-routing-resident-h200.jsonl \\
        --num-layers 16 --num-experts 128 --cache-slots 768 --out decode-cost-model.json

Each (token, layer) runs the plan of `freetoken.reference.expert_cache` (the engine's own
decisions, so hits, fetches and CPU experts are exactly the engine's for the same routing),
and costs
    layer time = max(fetched * fetch_us, [cpu experts > 0] * (cpu_call_us + cpu experts * cpu_expert_us))
                 + layer_us
a step being the sum over layers (batch-1 decode is layer-serial: the GPU's dense part and the
MoE branches of one layer do not overlap the next layer's). The defaults are fitted to the H200
runs in docs/lab/ (a CPU call's fixed cost is what a streaming bandwidth ratio leaves out:
one expert ~380 us on the critical path against ~250 us for a fetch).

`--branch-us` adds a fixed cost to every layer of a policy with a CPU branch (all but transfer):
the hand-off each such layer pays even when it routes nothing to the CPU (~23 us a layer in the
H200 device timeline, `graph-step-timeline-own-memops-h200.json`; 0 by default, as fitted before).

`hybrid` is the engine's hybrid without background fills (a layer waits for every fetch);
`hybrid-background` is the engine's hybrid with them (its default): a layer waits for
q*'s fetches only, and each background fill adds `--background-us` to its layer: what the fill
costs the step by contending with its kernels and CPU branch (~210 us fitted from the traced H200
run with fills started with the plan, `graph-step-timeline-own-background-fork-at-plan-h200.json`;
0, the default, prices fills that contend with nothing, e.g. copy-engine copies between steps).

Besides the engine's policies it prices candidates the engine does not have. `hybrid-lone`: hybrid,
but a layer's single miss is fetched (alone it has no PCIe work to overlap, and under looping
routing it comes back). `per-call`: q*
with the CPU call's fixed cost in it, F = argmin_F max(F * fetch_us, [M - F > 0] * (cpu_call_us +
(M - F) * cpu_expert_us)) (the larger F on a tie), then raised to the recurring misses as hybrid
does. It is a model's answer, to be measured before any policy adopts it.
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
from dataclasses import dataclass

from freetoken.moe.policy import sim_policy
from freetoken.reference.expert_cache import plan_layer, qstar, share_q16
from freetoken.reference.fetch_rule import FetchRule
from freetoken.sim.simulate import initial_state, trace_plans

POLICIES = ("transfer", "cpu", "static", "hybrid", "hybrid-background", "hybrid-qstar-alone", "hybrid-lone",
            "per-call")


@dataclass(frozen=True)
class Costs:
    fetch_us: float = 250.0  # one expert over PCIe into a slot, on the critical path
    cpu_call_us: float = 250.0  # a layer's CPU call, whatever it computes (hand-off, team, wait)
    cpu_expert_us: float = 130.0  # each expert the CPU call computes
    layer_us: float = 120.0  # the layer's dense GPU work and MoE GEMM
    branch_us: float = 0.0  # each layer's CPU hand-off in a policy with a CPU branch, work or not
    background_us: float = 0.0  # what each background fill costs its step (contention), hybrid-background

    def layer(self, fetched: int, on_cpu: int, branch: bool = True) -> float:
        cpu = self.cpu_call_us + on_cpu * self.cpu_expert_us if on_cpu else 0.0
        return max(fetched * self.fetch_us, cpu) + self.layer_us + (self.branch_us if branch else 0.0)

    def per_call_fetches(self, misses: int) -> int:
        return min(range(misses + 1), key=lambda f: (self.layer(f, misses - f), -f))


def model(plans, num_layers: int, num_experts: int, slots: int, policy: str, ratio: float, costs: Costs,
          warmup_tokens: int) -> dict:
    """Run `plans` [(layer, rows)] through `policy`; tok/s and counts after the warm-up."""
    state, _ = initial_state(policy if policy in ("static", "transfer", "cpu") else "hybrid", num_layers,
                              num_experts, slots)  # static: whole layers placed, the last ones on the GPU
    r16 = share_q16(ratio)
    seen = [0] * num_layers
    us = hits = misses = fetched = on_cpu = 0
    tokens = 0.0
    for layer, rows in plans:
        if policy == "per-call":
            # the engine's hybrid plan, at the ratio that makes q* fetch what the per-call cost wants
            misses_now = _misses(state, layer, rows, num_experts)
            want = costs.per_call_fetches(misses_now)
            plan = plan_layer(state, layer, rows, FetchRule.QSTAR_RECURRING, _ratio_fetching(misses_now, want, r16))
        elif policy == "hybrid-lone":
            lone = _misses(state, layer, rows, num_experts) == 1
            plan = plan_layer(state, layer, rows, FetchRule.QSTAR_RECURRING, 65536 if lone else r16)
        elif policy == "hybrid-qstar-alone":
            plan = plan_layer(state, layer, rows, FetchRule.QSTAR, r16)
        elif policy == "hybrid-background":
            plan = plan_layer(state, layer, rows, FetchRule.QSTAR_BACKGROUND, r16)
        else:
            plan = plan_layer(state, layer, rows, sim_policy(policy, background_fills=False).fetch_rule, r16)
        counted = seen[layer] >= warmup_tokens
        seen[layer] += len(rows)
        if not counted:
            continue
        tokens += len(rows) / num_layers
        hits, misses, fetched = hits + plan.hits, misses + plan.misses, fetched + plan.fetched
        on_cpu += plan.on_cpu
        us += costs.layer(len(plan.copies), plan.on_cpu, branch=policy != "transfer")
        us += len(plan.background) * costs.background_us
    return {"policy": policy, "tok_per_s": tokens / (us * 1e-6) if us else 0.0,
            "hit_rate": hits / max(1, hits + misses), "fetched_per_token": fetched / max(tokens, 1e-9),
            "cpu_experts_per_token": on_cpu / max(tokens, 1e-9)}


def _misses(state, layer: int, rows, num_experts: int) -> int:
    """Distinct experts of the layer's rows not in the cache (what the plan will count as misses)."""
    base = layer * num_experts
    return len({base + e for row in rows for e in row if state.slot_of[base + e] < 0})


@functools.cache  # a handful of (misses, want) pairs recur at every plan
def _ratio_fetching(misses: int, want: int, fallback_q16: int) -> int:
    """A Q16 ratio at which q*(misses) == want (the plan then adds the recurring misses)."""
    if misses == 0:
        return fallback_q16
    for r16 in range(64, 65537, 64):  # from above 0: at r = 0 no miss counts as recurring
        if qstar(misses, r16) == want:
            return r16
    return 65536 if want >= misses else fallback_q16


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True, help="routing trace (JSON lines), recorded or synthetic")
    p.add_argument("--num-layers", type=int, required=True)
    p.add_argument("--num-experts", type=int, required=True)
    p.add_argument("--cache-slots", type=int, required=True)
    p.add_argument("--ratio", type=float, default=0.473, help="the profile's r (default: the H200's)")
    p.add_argument("--warmup-tokens", type=int, default=16)
    for name, value in vars(Costs()).items():
        p.add_argument("--" + name.replace("_", "-"), type=float, default=value)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    costs = Costs(**{k: getattr(args, k) for k in vars(Costs())})
    plans, _ = trace_plans(args.trace, args.num_layers, args.num_experts, False)
    results = [model(plans, args.num_layers, args.num_experts, args.cache_slots, policy, args.ratio, costs,
                     args.warmup_tokens) for policy in POLICIES]
    for r in results:
        print(f"{r['policy']:20s} {r['tok_per_s']:7.1f} tok/s  hit {r['hit_rate']:.3f}  fetched/token "
              f"{r['fetched_per_token']:5.2f}  cpu experts/token {r['cpu_experts_per_token']:5.2f}", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m benchmarks.decode_cost_model " + shlex.join(
                argv if argv is not None else sys.argv[1:]), "costs_us": vars(costs), "ratio": args.ratio,
                "cache_slots": args.cache_slots, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
