"""Command lines `freetoken sim` (replay a routing trace through the cache policies) and
`freetoken sim-trace` (write a synthetic routing trace). Heavy imports happen inside `run_*`."""

from __future__ import annotations

import argparse
import json
import os
import sys

from freetoken.moe.policy import POLICIES, Hybrid


def _fractions(text: str) -> list[float]:
    try:
        out = [float(v.rstrip("%")) / (100 if v.endswith("%") else 1) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("no fractions given")
    return out


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="routing trace (JSON lines)")
    parser.add_argument("--num-layers", dest="num_layers", type=int, required=True)
    parser.add_argument("--num-experts", dest="num_experts", type=int, required=True)
    parser.add_argument(
        "--cache-slots",
        dest="cache_slots",
        type=int,
        default=None,
        help="GPU expert slots shared by all layers (required unless --sweep)",
    )
    parser.add_argument("--policy", choices=POLICIES, default=None, help="required unless --sweep")
    parser.add_argument(
        "--ratio",
        type=float,
        default=0.5,
        help="hybrid split r = B_pcie / (B_pcie + B_cpu), 0..1 (default 0.5)",
    )
    parser.add_argument(
        "--no-fetch-recurring",
        dest="fetch_recurring",
        action="store_false",
        help="hybrid by q* alone: do not fetch misses that plain LRU would still hold",
    )
    parser.add_argument(
        "--no-background-fills",
        dest="background_fills",
        action="store_false",
        help="hybrid: a layer waits for the fetches beyond q*'s share (recurring misses, free slots, every miss "
        "where q* fetches none) instead of running them on the CPU while they fill for later steps",
    )
    parser.add_argument(
        "--expert-bytes",
        dest="expert_bytes",
        type=int,
        default=None,
        help="bytes of one expert's weights (default Qwen3-30B-A3B bf16: 3*2048*768*2)",
    )
    parser.add_argument(
        "--warmup-tokens",
        dest="warmup_tokens",
        type=int,
        default=0,
        help="leave each layer's first N tokens out of the counts",
    )
    parser.add_argument(
        "--remap",
        action="store_true",
        help="map a trace of another shape onto the model (layers proportionally, experts by "
        "modulo or a fixed permutation)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--sweep",
        metavar="OUT_PREFIX",
        default=None,
        help="sweep cache sizes for every policy; write OUT_PREFIX.json and OUT_PREFIX.png",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="processes for --sweep (default: the number of CPUs, at most 8)",
    )
    parser.add_argument(
        "--fractions",
        type=_fractions,
        default=None,
        help="sweep cache sizes as fractions of the pool, e.g. 0.05,0.1,0.25,0.5,1",
    )


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GiB"


def run_sim(args: argparse.Namespace) -> int:
    from freetoken.sim.simulate import DEFAULT_EXPERT_BYTES, DEFAULT_FRACTIONS, format_table, simulate, sweep
    from freetoken.trace.routing import RoutingTrace, TraceError

    expert_bytes = args.expert_bytes if args.expert_bytes is not None else DEFAULT_EXPERT_BYTES
    try:
        trace = RoutingTrace.load(args.trace)
        if args.sweep is not None:
            result = sweep(
                trace,
                args.num_layers,
                args.num_experts,
                fractions=args.fractions or DEFAULT_FRACTIONS,
                ratio=args.ratio,
                expert_bytes=expert_bytes,
                warmup_tokens=args.warmup_tokens,
                remap=args.remap,
                out_prefix=args.sweep,
                fetch_recurring=args.fetch_recurring,
                workers=args.workers or min(8, os.cpu_count() or 1),
            )
            if args.json:
                print(json.dumps(result))
            else:
                print(format_table(result))
                print(f"wrote {args.sweep}.json and {args.sweep}.png")
            return 0
        if args.cache_slots is None or args.policy is None:
            print("sim: error: --cache-slots and --policy are required (or use --sweep)", file=sys.stderr)
            return 2
        r = simulate(
            trace,
            args.num_layers,
            args.num_experts,
            args.cache_slots,
            args.policy,
            ratio=args.ratio,
            expert_bytes=expert_bytes,
            warmup_tokens=args.warmup_tokens,
            remap=args.remap,
            fetch_recurring=args.fetch_recurring,
            background_fills=args.background_fills,
        )
    except TraceError as exc:
        print(f"sim: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"sim: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(r.to_dict()))
        return 0
    print(
        f"policy {r.policy}, {r.cache_slots} slots of {r.num_layers * r.num_experts}, "
        f"{r.tokens:g} tokens" + (f", ratio {r.ratio:g}" if r.policy == Hybrid.name else "")
    )
    if POLICIES[r.policy].fixed_placement and not POLICIES[r.policy].every_expert:
        n_gpu = len(r.gpu_layers)
        print(f"layers on the GPU: {n_gpu} (the last ones), on the CPU: {r.num_layers - n_gpu}")
    print(f"hit rate            {r.hit_rate:.4f}")
    print(
        f"misses per token    {r.misses_per_token:.3f}  (fetched {r.fetched_per_token:.3f}, "
        f"on CPU {r.cpu_experts_per_token:.3f})"
    )
    print(f"PCIe per token      {_human_bytes(r.pcie_bytes_per_token)}")
    print(f"CPU reads per token {_human_bytes(r.cpu_bytes_per_token)}")
    return 0


def add_synth_trace_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        choices=("olmoe", "mixtral", "uniform"),
        default="olmoe",
        help="calibrated skew and reuse (default olmoe)",
    )
    parser.add_argument("--num-layers", dest="num_layers", type=int, default=None)
    parser.add_argument("--num-experts", dest="num_experts", type=int, default=None)
    parser.add_argument("--top-k", dest="top_k", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=512, help="decode tokens (default 512)")
    parser.add_argument("--skew", type=float, default=None, help="override the preset's Zipf exponent")
    parser.add_argument("--reuse", type=float, default=None, help="override the preset's repeat probability")
    parser.add_argument(
        "--window", type=int, default=None, help="override how many previous tokens reuse sees"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="output trace (JSON lines)")
    parser.add_argument("--stats", action="store_true", help="print the trace's routing statistics")


def run_synth_trace(args: argparse.Namespace) -> int:
    from freetoken.sim.synthetic import calibrated, format_stats, generate, trace_stats, write_trace
    from freetoken.trace.routing import TraceError

    try:
        cfg = calibrated(
            args.preset,
            num_layers=args.num_layers,
            num_experts=args.num_experts,
            top_k=args.top_k,
            num_tokens=args.tokens,
            seed=args.seed,
            skew=args.skew,
            reuse=args.reuse,
            window=args.window,
        )
        ids = generate(cfg)
        write_trace(ids, args.out)
    except TraceError as exc:
        print(f"sim-trace: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"sim-trace: error writing {args.out}: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {args.out}: {cfg.num_tokens} tokens x {cfg.num_layers} layers, {cfg.num_experts} experts, "
        f"top-{cfg.top_k}, skew {cfg.skew:g}, reuse {cfg.reuse:g}, window {cfg.window}"
    )
    if args.stats:
        print(format_stats(trace_stats(ids, num_experts=cfg.num_experts)))
    return 0
