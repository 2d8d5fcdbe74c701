"""A decode floor that respects the layer order, next to `bench decode`'s floor.

    python -m benchmarks.layer_serial_floor --bench benchmarks/results/decode-graphs-replayed-routing-h200.json \\
        --trace TRACE.jsonl --num-layers 16 --num-experts 128 [--out FILE]

`bench decode`'s floor is max(PCIe bytes / B_pcie, CPU bytes / B_cpu) per step plus the device's
own reads: it lets one layer's copies overlap another layer's CPU work. At batch 1 a layer's
experts are known only after its router has run on the previous layer's output, so without
speculation each layer pays max(its PCIe bytes / B_pcie, its CPU bytes / B_cpu) on its own; the
sum over layers (plus the same device reads) is a floor for any engine that does not fetch
ahead of the router, and never below the bench's. Per-layer counts come from running the
engine's plans (`freetoken.reference.expert_cache`, as `sim` and `decode_cost_model` do) over the
trace the bench replayed over the bench's tokens (a synthetic trace's prompt tokens are planned
one by one where the bench plans the prompt at once), so the hit rates are the simulator's,
equal or close to the bench's (printed side by side). Bandwidths, bytes and measured tok/s are the bench
file's.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from freetoken.moe.policy import sim_policy
from freetoken.reference.expert_cache import plan_layer, share_q16
from freetoken.sim.simulate import initial_state, trace_plans


def layer_serial_floor(plans, bench: dict, result: dict, num_layers: int, num_experts: int,
                       warmup_tokens: int, decode_tokens: int) -> dict:
    """Mean floors per step (ms) for one policy's bench result: tokens [warmup_tokens,
    warmup_tokens + decode_tokens) of each layer's plans are counted (a prompt's rows count as
    tokens), as the bench counts its decode steps after its prompt and warm-up."""
    bw, eb = bench["bandwidths"], bench["model"]["expert_bytes"]
    pair, solo = (bw["pcie_Bps"], bw["cpu_Bps"]), (bw["pcie_solo_Bps"], bw["cpu_solo_Bps"])
    policy = result["policy"]
    state, _ = initial_state(policy, num_layers, num_experts, result["slots"])
    r16 = share_q16(result["ratio"] or 0.0)
    # (results from before the policies' parameters were recorded name fetch_recurring alone)
    fetch_recurring = result.get("policy_params", result).get("fetch_recurring", True)
    rule = sim_policy(policy, fetch_recurring, background_fills=False).fetch_rule
    seen = [0] * num_layers
    tokens = serial = pcie = cpu = gpu = hits = routed = 0.0
    for layer, rows in plans:
        plan = plan_layer(state, layer, rows, rule, r16)
        counted = warmup_tokens <= seen[layer] < warmup_tokens + decode_tokens
        seen[layer] += len(rows)
        if not counted:
            continue
        tokens += len(rows) / num_layers
        on_cpu = plan.misses - plan.fetched
        p_bps, c_bps = pair if plan.fetched and on_cpu else solo
        serial += max(plan.fetched * eb / p_bps, on_cpu * eb / c_bps)
        pcie, cpu = pcie + plan.fetched * eb, cpu + on_cpu * eb
        gpu += (plan.hits + plan.fetched) * eb
        hits, routed = hits + plan.hits, routed + plan.hits + plan.misses
    steps = max(tokens, 1e-9)
    # each file's own figure, so this floor stays the bench's: files written before "dense_read_bytes"
    # counted the embedding table whole in "dense_bytes"
    dense = result["dense_read_bytes"] if "dense_read_bytes" in result else result["dense_bytes"]
    device_s = (dense + gpu / steps) / bw["device_read_Bps"]
    p_bps, c_bps = pair if pcie and cpu else solo
    whole = max(pcie / steps / p_bps, cpu / steps / c_bps) + device_s
    serial_ms = (serial / steps + device_s) * 1e3
    return {"policy": policy, "tok_per_s": result["tok_per_s"], "bench_hit_rate": result["hit_rate"],
            "sim_hit_rate": hits / max(routed, 1), "floor_ms": whole * 1e3, "layer_serial_floor_ms": serial_ms,
            "of_floor": whole * 1e3 / result["ms_per_token"],
            "of_layer_serial_floor": serial_ms / result["ms_per_token"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench", required=True, help="a `bench decode` results file")
    p.add_argument("--trace", required=True, help="the routing trace that bench replayed")
    p.add_argument("--num-layers", type=int, required=True)
    p.add_argument("--num-experts", type=int, required=True)
    p.add_argument("--warmup-tokens", type=int, default=48,
                   help="tokens before the counted ones (the bench's prompt plus its warm-up: 32 + 16)")
    p.add_argument("--decode-tokens", type=int, default=48, help="tokens counted, as the bench's")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    bench = json.load(open(args.bench))
    plans, _ = trace_plans(args.trace, args.num_layers, args.num_experts, False)
    rows = [layer_serial_floor(plans, bench, r, args.num_layers, args.num_experts, args.warmup_tokens,
                               args.decode_tokens)
            for r in bench["results"] if r["policy"] != "resident"]
    for r in rows:
        print(f"{r['policy']:9s} {r['tok_per_s']:7.1f} tok/s  hit bench {r['bench_hit_rate']:.3f} sim "
              f"{r['sim_hit_rate']:.3f}  floor {r['floor_ms']:.2f} ms ({r['of_floor']:.0%})  layer-serial "
              f"{r['layer_serial_floor_ms']:.2f} ms ({r['of_layer_serial_floor']:.0%})", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m benchmarks.layer_serial_floor " + shlex.join(
                sys.argv[1:] if argv is None else argv), "bench": args.bench, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
