"""`python -m freetoken bench decode`: decode speed of every policy on one model, side by side.

For each policy: prefill B prompts, decode a warm-up, then time D decode steps (greedy).
Reports tok/s, hit rate, experts fetched and CPU-computed per token, the bytes that crossed
PCIe and that the CPU streamed per token, and the floor those bytes imply at the measured
bandwidths (`bench bw` profile of the pool's format, moe/profile_key.py): per token,
max(PCIe bytes / B_pcie, CPU bytes / B_cpu) plus the device's own reads (dense weights, KV and
cached experts) at its memory bandwidth. Bytes are the format's: a fill copies a bank row (as
wide as the widest layer), a kernel reads only its layer's rows (`layer_read_bytes`).
In graph mode also the device time a step and, with a CPU branch, the time its poller took to
answer the step's rings (ring seen to answer written): when a run is slow, whether the CPU was.
The host expert pool is loaded once and shared by every policy's runner.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from msgspec.structs import replace

from freetoken.bench.host_usage import checkpoint_bytes, peak_rss_bytes
from freetoken.bench.moe_params import add_moe_param_argument, for_policy, moe_config_fields
from freetoken.cli_args import add_engine_arguments, engine_config_from
from freetoken.moe.policy import AUTO, POLICIES
from freetoken.progress import Progress

# the engine flags a decode run takes as serve does (--policies, --modes and --pdl pick the variants)
ENGINE_FLAGS = ("--device", "--moe-cache-slots", "--moe-cache-rate", "--cpu-threads", "--bw-profile", "--moe-gemm",
                "--record-routing", "--routing-replay")


def add_bench_decode_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory or GGUF file")
    add_engine_arguments(p, ENGINE_FLAGS, helps={"--record-routing": (
        "write the run's routing here (one policy only; decode then runs eager): replayed with "
        "--routing-replay, every policy sees the same token trajectory")})
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated, from {', '.join(POLICIES)}, {AUTO} (its live choice makes its first "
                        "probe after 32 steps and settles about 21 steps later: give it the --warmup-tokens)")
    add_moe_param_argument(p)
    p.add_argument("--modes", default="graph,eager",
                   help="decode modes to time, comma-separated: graph (CUDA graphs), eager; CPU runs eager only")
    p.add_argument("--pdl", default="on", choices=["on", "off", "both"],
                   help="programmatic dependent launch of the engine's Triton kernels (see --no-pdl of serve); "
                        "both: time each, taking turns")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--warmup-tokens", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1,
                   help="run every (policy, variant) this many times, taking turns (so that drift in the machine "
                        "hits each alike); the reported run is the median by tok/s, with every sample listed")
    p.add_argument("--trace", default=None,
                   help="write a Perfetto timeline of each policy's run here (several policies: one file each, "
                   "the policy's name added before the suffix); in graph mode it has the device's layer phases")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None, help="write tok/s per run, with measured/floor, as a PNG here")


def run_bench_decode(args: argparse.Namespace) -> int:
    import torch

    from freetoken.cache.host_pool import HostExpertPool
    from freetoken.config import ModelConfig
    from freetoken.moe.bandwidth_profile import load_ratio, solo_bandwidths
    from freetoken.moe.profile_key import profile_key

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES and p != AUTO]
    if unknown:
        print(f"bench decode: unknown policies {unknown}; choose from {', '.join(POLICIES)}, {AUTO}", file=sys.stderr)
        return 2
    if args.record_routing and (len(policies) != 1 or args.routing_replay):
        print("bench decode: --record-routing records one run: one policy, no --routing-replay", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(f"bench decode: --repeats takes a count >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    if args.repeats > 1 and (args.trace or args.record_routing):
        print("bench decode: --trace and --record-routing record one run each: leave --repeats at 1", file=sys.stderr)
        return 2
    try:
        moe_fields = moe_config_fields(args.moe_param)
    except ValueError as err:
        print(f"bench decode: {err}", file=sys.stderr)
        return 2
    cfg = ModelConfig.from_checkpoint(args.model)
    started = time.perf_counter()
    pool = HostExpertPool.load(args.model, cfg)
    pool.pin()
    load_s = time.perf_counter() - started
    print(f"[bench] host pool {pool.nbytes / 1e9:.1f} GB ({pool.format.name} experts, "
          f"{pool.expert_bytes / 1e6:.2f} MB each) loaded and pinned in {load_s:.1f} s", file=sys.stderr)
    device = engine_config_from(args, ENGINE_FLAGS).resolved_device()  # (--device auto: the config decides)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    key = profile_key(pool.format)
    pcie_bps, cpu_bps, bw_source = load_ratio(args.bw_profile, gpu, key)
    solo = solo_bandwidths(args.bw_profile, gpu, key)
    hbm_bps = _device_read_bandwidth(device)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if any(m not in ("graph", "eager") for m in modes):
        print(f"bench decode: --modes takes graph and/or eager, got {args.modes!r}", file=sys.stderr)
        return 2
    if device != "cuda":
        modes = ["eager"]
    switch = {"on": [True], "off": [False], "both": [True, False]}
    pdls = switch[args.pdl] if device == "cuda" else [True]
    runs = [(p, mode, pdl) for p in policies for mode in modes for pdl in pdls]
    samples: list[list[dict]] = [[] for _ in runs]
    with Progress("bench decode", len(runs) * args.repeats, unit="runs") as progress:
        for repeat in range(args.repeats):  # the runs take turns, so drift over time hits each alike
            for (policy, mode, pdl), taken in zip(runs, samples, strict=True):
                result = _run_policy(args, policy, pool, device, eager=mode == "eager", pdl=pdl,
                                     moe_fields=moe_fields)
                if device == "cuda":
                    # The last run's slots and graph pools go with its runner; a runner caught in a
                    # reference cycle is freed only by the collector, and a dozen runs in one process
                    # ran the device out of memory without it.
                    gc.collect()
                    torch.cuda.empty_cache()
                add_floor(result, (pcie_bps, cpu_bps), solo, hbm_bps)
                taken.append(result)
                progress.write(_line(result) + (f"  (repeat {repeat + 1}/{args.repeats})" if args.repeats > 1 else ""))
                progress.advance(1, f"{policy} {mode}")
    results = [median_run(taken) for taken in samples]
    if args.repeats > 1:
        for result in results:
            low, high = min(result["tok_per_s_samples"]), max(result["tok_per_s_samples"])
            print(_line(result) + f"  (median of {args.repeats}, {low:.2f}-{high:.2f})", file=sys.stderr)
    report = {
        "command": "python -m freetoken bench decode " + " ".join(sys.argv[3:]),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"gpu": gpu, "cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
        "model": {"dir": str(args.model), "arch": cfg.arch, "layers": cfg.num_layers, "experts": cfg.num_experts,
                  "top_k": cfg.top_k, "expert_bytes": pool.expert_bytes, "expert_format": pool.format.name,
                  "profile_key": key,
                  "pool_experts": cfg.num_sparse_layers * cfg.num_experts,
                  "checkpoint_bytes": checkpoint_bytes(args.model), "pool_bytes": pool.nbytes},
        # the host memory the targets bound: the process's peak resident set over every run
        "host": {"pool_load_and_pin_s": load_s, "peak_rss_bytes": peak_rss_bytes()},
        "bandwidths": {"pcie_Bps": pcie_bps, "cpu_Bps": cpu_bps, "pcie_solo_Bps": solo[0], "cpu_solo_Bps": solo[1],
                       "source": bw_source, "device_read_Bps": hbm_bps},
        "batch": args.batch,
        "routing": args.routing_replay or "checkpoint's own router",
        "results": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        from freetoken.bench.plots import plot_decode

        plot_decode(report, args.plot)
    print(json.dumps(results, indent=1))
    pool.unpin()
    return 0


def median_run(samples: list[dict]) -> dict:
    """One run's repetitions -> the repetition with the median tok/s (the lower middle one for an
    even count), whole, so that its figures stay consistent with each other; with more than one,
    plus `repeats` and every repetition's figures that vary from turn to turn, in run order
    (`tok_per_s_samples`, and where measured `device_ms_samples`, `cpu_answer_ms_samples`, and the
    slowest step, slow steps, steal and involuntary switches: `step_ms_max_samples`, ...)."""
    if len(samples) == 1:
        return samples[0]
    middle = sorted(samples, key=lambda r: r["tok_per_s"])[(len(samples) - 1) // 2]
    out = {**middle, "repeats": len(samples), "tok_per_s_samples": [r["tok_per_s"] for r in samples]}
    per_turn = (("device_ms_per_step", "device_ms_samples"), ("cpu_answer_ms_per_step", "cpu_answer_ms_samples"),
                ("step_ms_max", "step_ms_max_samples"), ("slow_steps", "slow_steps_samples"),
                ("steal_ms", "steal_ms_samples"), ("involuntary_switches", "involuntary_switches_samples"))
    for field, key in per_turn:
        if all(field in r for r in samples):
            out[key] = [r[field] for r in samples]
    return out


def trace_path(path: str, policy: str, policies: str) -> str:
    """The trace file of one policy: `path` itself when one policy runs, else `path` with the
    policy's name before the suffix (trace.json -> trace-hybrid.json)."""
    if len([p for p in policies.split(",") if p.strip()]) == 1:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}-{policy}{p.suffix}"))


def _run_policy(args: argparse.Namespace, policy: str, pool, device: str, eager: bool, pdl: bool = True,
                moe_fields: dict | None = None) -> dict:
    """One timed run; moe_fields: MoeConfig fields from --moe-param (default: `args.moe_param`'s)."""
    from freetoken.bench.host_noise import counters_delta, read_counters, step_spread
    from freetoken.cache.slot_cache import STAT_FIELDS
    from freetoken.engine.model_runner import ModelRunner
    from freetoken.trace import NULL_RECORDER, TraceRecorder

    total = args.prompt_tokens + args.warmup_tokens + args.decode_tokens + 1
    if moe_fields is None:
        moe_fields = moe_config_fields(getattr(args, "moe_param", []))
    base = engine_config_from(args, ENGINE_FLAGS)
    moe = replace(base.moe, policy=policy, **for_policy(policy, moe_fields))
    if policy == "resident":  # every expert has a slot
        moe = replace(moe, cache_slots=None, cache_rate=None)
    config = replace(base, model=args.model, device=device, max_model_len=total, moe=moe,
                     graphs=replace(base.graphs, eager=eager), kernels=replace(base.kernels, pdl=pdl))
    # Traces show the default path (graph mode on CUDA), one file per policy.
    traced = args.trace and (not eager or device != "cuda")
    recorder = TraceRecorder() if traced else NULL_RECORDER
    runner = ModelRunner(args.model, config, rows=args.batch, recorder=recorder, pool=pool)
    rows = GreedyRows(runner, args.batch, args.prompt_tokens)
    step, events, timed = rows.step, rows.events, rows.timed

    for _ in range(args.warmup_tokens):
        step()
    events.clear()
    runner.sync_stats()
    stats = runner.slots.stats
    before = {k: list(getattr(stats, k)) for k in STAT_FIELDS}
    recorder.clear()
    answered = runner.graphs.cpu_answer_ns() if timed else 0
    modes_before = None if runner.live_choice is None else dict(runner.live_choice.mode_steps)
    host_before = read_counters()
    step_seconds = []
    t0 = time.perf_counter()
    for _ in range(args.decode_tokens):
        t = time.perf_counter()
        step()
        step_seconds.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - t0
    host = counters_delta(host_before, read_counters())
    answered = runner.graphs.cpu_answer_ns() - answered if timed else 0
    runner.sync_stats()
    if recorder.enabled:
        recorder.write_perfetto(trace_path(args.trace, policy, args.policies))
    per_layer = {k: [now - then for now, then in zip(getattr(stats, k), v, strict=True)] for k, v in before.items()}
    delta = {k: sum(v) for k, v in per_layer.items()}
    tokens = args.decode_tokens * args.batch
    steps = args.decode_tokens
    eb = pool.expert_bytes  # a fill copies whole bank rows
    read = layer_read_bytes(pool.format, pool.config, eb)
    cpu_experts = [m - f + b for m, f, b in zip(per_layer["misses"], per_layer["fetched"], per_layer["background"],
                                                 strict=True)]
    gpu_experts = [h + f for h, f in zip(per_layer["hits"], per_layer["fetched"], strict=True)]
    report = runner.report
    result = {
        "policy": policy,
        "mode": "eager" if eager or device != "cuda" else "graph",
        "slots": report.slots,
        "cache_fraction": report.slots / report.pool_experts,
        "ratio": report.ratio,
        "policy_params": runner.slots.policy.params(),
        # who ran them in captured steps (None: no background fills captured)
        "background_filler": None if runner.graphs is None else runner.graphs.background_filler(),
        # asked for (None off CUDA, where it never applies; kernels/triton/pdl.py says where it does)
        "pdl": config.kernels.pdl if device == "cuda" else None,
        "tok_per_s": tokens / elapsed,
        "ms_per_token": elapsed / steps * 1e3,  # per decode step (one token per sequence)
        "hit_rate": delta["hits"] / max(1, delta["hits"] + delta["misses"]),
        "fetched_per_step": delta["fetched"] / steps,
        "cpu_experts_per_step": (delta["misses"] - delta["fetched"] + delta["background"]) / steps,
        "pcie_bytes_per_step": delta["fetched"] * eb / steps,
        "cpu_bytes_per_step": sum(n * b for n, b in zip(cpu_experts, read, strict=True)) / steps,
        "gpu_expert_bytes_per_step": sum(n * b for n, b in zip(gpu_experts, read, strict=True)) / steps,
        # dense weights a step reads (results files before this key had "dense_bytes", which
        # counted the untied embedding table whole, though a step gathers a row of it per token)
        "dense_read_bytes": runner.weights.step_read_bytes(),
        # how the steps spread, and what the host's schedulers took meanwhile (bench/host_noise.py)
        **step_spread(step_seconds), **host,
    }
    if modes_before is not None:  # auto: the modes its timed steps ran, and its state at the end
        result["live_policy"] = {**runner.live_choice.status(), "timed_mode_steps": {
            m: n - modes_before[m] for m, n in runner.live_choice.mode_steps.items()}}
    if timed:
        device_ms = sum(a.elapsed_time(b) for a, b in events) / steps
        result["device_ms_per_step"] = device_ms
        result["non_kernel_overhead"] = 1 - device_ms / result["ms_per_token"]
        result["cpu_doorbell"] = runner.graphs.mechanism
        if runner.graphs.mailbox is not None:  # (a CPU branch: what its poller spent answering)
            result["cpu_answer_ms_per_step"] = answered / 1e6 / steps
    runner.close()
    return result


def layer_read_bytes(fmt, config, expert_bytes: int) -> list[int]:
    """Per layer, the bytes a kernel reads of one of its experts: a block format's layer rows (a
    narrower layer's padding is never read), else the whole expert (`expert_bytes`)."""
    from freetoken.moe.block_format import BlockQuantFormat

    if isinstance(fmt, BlockQuantFormat):
        return [2 * fmt.gate_up_bytes(layer) + fmt.down_bytes(layer) for layer in range(config.num_layers)]
    return [expert_bytes] * config.num_layers


def floor_ms(r: dict, pair: tuple[float, float], solo: tuple[float, float], hbm_bps: float) -> float:
    """Lower bound per step: the slower off-device branch plus the device's own reads. A step
    that uses both PCIe and the CPU gets the bandwidths measured with both running (`pair`,
    they share the memory controller); one that uses a single path gets that path alone."""
    pcie, cpu = r["pcie_bytes_per_step"], r["cpu_bytes_per_step"]
    pcie_bps, cpu_bps = pair if pcie and cpu else solo
    offload = max(pcie / pcie_bps, cpu / cpu_bps)
    device = (r["dense_read_bytes"] + r["gpu_expert_bytes_per_step"]) / hbm_bps
    return (offload + device) * 1e3


def add_floor(r: dict, pair: tuple[float, float], solo: tuple[float, float], hbm_bps: float) -> None:
    """A run's floor (`floor_ms`) and its measured time over it, into the run's figures."""
    r["floor_ms_per_token"] = floor_ms(r, pair, solo, hbm_bps)
    r["measured_over_floor"] = r["ms_per_token"] / r["floor_ms_per_token"]


def _device_read_bandwidth(device: str) -> float:
    """Bytes/s the compute device reads (a large reduction), for the floor's on-device part."""
    import torch

    n = (1 << 30) if device == "cuda" else (1 << 26)
    x = torch.ones(n // 2, dtype=torch.bfloat16, device=device)
    x.sum()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        x.sum()
    if device == "cuda":
        torch.cuda.synchronize()
    return 5 * x.nbytes / (time.perf_counter() - t0)


def _line(r: dict) -> str:
    name = r["policy"]
    if r["policy"] == "hybrid":
        params = r["policy_params"]
        name += "" if params["background_fills"] else ", waits" if params["fetch_recurring"] else ", q* alone"
        if r.get("background_filler") == "stream":
            name += ", fills on the step's stream"
        if r.get("background_filler") == "copy":
            name += f", depth {params['copy_fill_depth']}"
    if "live_policy" in r:  # auto: the modes of the timed steps
        name += " (" + ", ".join(f"{m} {n}" for m, n in r["live_policy"]["timed_mode_steps"].items() if n) + ")"
    if r.get("pdl") is False:
        name += ", no PDL"
    return (f"[bench] {name:9s} {r['mode']:5s} {r['tok_per_s']:8.2f} tok/s  hit {r['hit_rate']:.3f}  "
            f"fetched/step {r['fetched_per_step']:6.1f}  cpu experts/step {r['cpu_experts_per_step']:6.1f}  "
            f"PCIe {r['pcie_bytes_per_step'] / 1e6:8.1f} MB/step  CPU {r['cpu_bytes_per_step'] / 1e6:8.1f} MB/step  "
            f"measured/floor {r['measured_over_floor']:.2f}"
            + (f"  non-kernel {r['non_kernel_overhead']:.1%}" if "non_kernel_overhead" in r else "")
            + (f"  CPU answers {r['cpu_answer_ms_per_step']:.2f} ms/step" if "cpu_answer_ms_per_step" in r else "")
            + f"  step median {r['step_ms_median']:.2f} max {r['step_ms_max']:.2f} ms ({r['slow_steps']} over 2x)"
            + (f"  steal {r['steal_ms']:.0f} ms" if r.get("steal_ms") is not None else "")
            + (f"  involuntary switches {r['involuntary_switches']}" if r.get("involuntary_switches") is not None
               else ""))


class GreedyRows:
    """`batch` rows of random prompts prefilled on `runner`, then decoded greedily a step at a
    time (`step`); in graph mode, CUDA events around each step's device work (inputs, replay,
    logits) in `events`, so the host time outside them (input prep, launch, sampling) shows as
    non-kernel overhead."""

    def __init__(self, runner, batch: int, prompt_tokens: int) -> None:
        import torch

        vocab = min(runner.model_config.vocab_size, 1000)
        gen = torch.Generator().manual_seed(0)
        self.runner = runner
        self.rows = list(range(batch))
        self.names = [f"bench-{row}" for row in self.rows]  # routing records name their rows' sequences
        self.prompt_tokens = prompt_tokens
        self.last = []
        for row in self.rows:
            prompt = torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist()
            runner.set_context([self.names[row]], "prefill", [0])
            self.last.append(int(runner.prefill(runner.row_pages(row), prompt,
                                                state_slot=runner.row_state_slot(row)).argmax()))
        self.pos = prompt_tokens
        self.timed = runner.graphs is not None
        self.events: list = []

    def step(self) -> None:
        import torch

        runner = self.runner
        tables = [runner.row_pages(r) for r in self.rows]
        runner.set_context(self.names, "decode", [self.pos - self.prompt_tokens + 1] * len(self.rows))
        if self.timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        slots = None if runner.states is None else [runner.row_state_slot(r) for r in self.rows]
        logits = runner.decode(tables, self.last, [self.pos] * len(self.rows), slots)
        if self.timed:
            end.record()
            self.events.append((start, end))
        self.last = logits.argmax(dim=-1).tolist()  # .tolist() syncs
        self.pos += 1
