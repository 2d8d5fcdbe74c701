"""How the engine fares on a shared machine: quiet and under interference it starts itself, in one run.

Interference: busy-loop processes (each pinned to one of the last cores this process may use, or
left to the scheduler with --busy-placement free) and, on CUDA, a process copying pinned host
memory to the GPU in a loop. Measured:
  - CUDA: graph-mode decode tok/s of hybrid and transfer with 0, 1 and 4 busy cores, the copy
    process, and 4 busy cores plus the copy process; the host pool's fill and pin, quiet and with
    one busy core;
  - CPU: the demo model's 64-token greedy request, quiet and beside one busy process.
Every measurement runs in a child process under a hard timeout, and each loaded run has its own
time cap, so a freeze is reported as one (tokens done when the cap hit) instead of waited for.
The targets (issue 28, item 6) are checked in the JSON's "targets".

    python -m benchmarks.cpu_interference --out result.json                       # CPU: demo model
    python -m benchmarks.cpu_interference --model DIR --routing-replay TRACE \\
        --moe-cache-slots 768 --bw-profile PROFILE --out result.json              # CUDA
    (--policies hybrid,hybrid:ratio=0.2,transfer --loads quiet,copy --no-pool: a chosen part)
    (--policies hybrid:adaptive=true,hybrid:adaptive=false,transfer,cpu,auto --no-pool: the live
     split against the profile's, each single path and auto's live choice, issue 34's comparison;
     each record of a live split carries its r over the load's steps, auto's its modes and probes;
     auto's start-up runs past its warm-up and first probe, so the loads time the mode it chose
     and the probes their changes start; benchmarks/contention_plot.py draws the result)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.child_records import json_line_records

BUSY_LOOP = """import os, sys
cpu = int(sys.argv[1])
if cpu >= 0:
    os.sched_setaffinity(0, {cpu})
while True:
    pass
"""
# Copies 256 MiB of pinned host memory to the device, again and again; says "ready" once copying.
PINNED_COPY = """import torch
src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
dst = torch.empty_like(src, device="cuda")
dst.copy_(src, non_blocking=True)
torch.cuda.synchronize()
print("ready", flush=True)
while True:
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
"""
# auto's start-up before the first load: at most this many steps more, for its warm-up and first
# probe (32 + 3 * 7 with the defaults of reference/policy_choice.py)
AUTO_START_STEPS = 96
LOADS = {"quiet": (0, False), "busy1": (1, False), "busy4": (4, False), "copy": (0, True), "busy4+copy": (4, True)}


def _die_with_parent() -> None:
    """In a child before exec: killed when the process that started it dies (a timed-out child's
    interference must not outlive it)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def interference(busy: int, copy: bool, placement: str):
    """`busy` busy-loop processes and, if `copy`, the pinned-copy process, for the block's time."""
    cpus = sorted(os.sched_getaffinity(0))
    procs = []
    try:
        for i in range(busy):
            cpu = cpus[-1 - i % len(cpus)] if placement == "pinned" else -1
            procs.append(subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(cpu)], preexec_fn=_die_with_parent))
        if copy:
            proc = subprocess.Popen([sys.executable, "-c", PINNED_COPY], stdout=subprocess.PIPE, text=True,
                                    preexec_fn=_die_with_parent)
            procs.append(proc)
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("the pinned-copy process did not start copying")
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def child_demo(args: argparse.Namespace) -> None:
    """The demo model's 64-token greedy request, quiet and beside one busy process: one JSON
    line per load with each request's seconds (a request past --cap-s is reported as frozen)."""
    import anyio

    from freetoken.config import EngineConfig, SamplingParams
    from freetoken.engine.llm import AsyncLLM

    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)

    async def request(llm, rid: str) -> float | None:
        started = time.perf_counter()
        with anyio.move_on_after(args.cap_s):
            async for chunk in llm.generate([5, 9, 14, 200, 31, 7], params, rid):
                if chunk.error:
                    raise RuntimeError(chunk.error)
            return time.perf_counter() - started
        return None

    async def main() -> None:
        async with AsyncLLM.start(EngineConfig(model="demo", device="cpu")) as llm:
            await request(llm, "warm-up")
            for load in ("quiet", "busy1", "quiet"):  # quiet on both sides: drift shows as their difference
                busy, _ = LOADS[load]
                with interference(busy, False, args.busy_placement):
                    seconds = [await request(llm, f"{load}-{i}") for i in range(args.repeats)]
                _emit({"part": "demo", "load": load, "seconds": seconds,
                       "frozen": any(s is None for s in seconds)})

    anyio.run(main)


def child_pool(args: argparse.Namespace) -> None:
    """Fill and pin the host pool once (under whatever interference the parent started)."""
    from freetoken.cache.host_pool import HostExpertPool
    from freetoken.config import ModelConfig

    started = time.perf_counter()
    pool = HostExpertPool.load(args.model, ModelConfig.from_dir(args.model))
    filled = time.perf_counter()
    pool.pin()
    _emit({"part": "pool", "fill_s": filled - started, "pin_s": time.perf_counter() - filled, "pinned": pool.pinned,
           "gb": pool.nbytes / 1e9})


def child_decode(args: argparse.Namespace) -> None:
    """Each policy's (comma-separated) graph-mode decode under every load in turn, one runner per
    policy over one pinned pool: a JSON line per load. (Without CUDA, eager decode and no
    pinned-copy loads: a dry run of the script.)"""
    import gc

    import torch

    from freetoken.cache.host_pool import HostExpertPool
    from freetoken.config import ModelConfig

    pool = HostExpertPool.load(args.model, ModelConfig.from_dir(args.model))
    pool.pin()
    for policy in args.policy.split(","):
        _decode_under_loads(args, policy, pool)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _decode_under_loads(args: argparse.Namespace, variant: str, pool) -> None:
    import torch

    from freetoken.config import EngineConfig, MoeConfig, TraceConfig
    from freetoken.engine.model_runner import ModelRunner

    cuda = torch.cuda.is_available()
    chosen = args.loads.split(",")
    loads = {name: load for name, load in LOADS.items() if (cuda or not load[1]) and name in chosen}
    policy, params = _variant(variant)
    steps_per_load = args.warmup_tokens + args.decode_tokens
    config = EngineConfig(model=args.model, device="cuda" if cuda else "cpu",
                          max_model_len=args.prompt_tokens + steps_per_load * (len(loads) + 1) + AUTO_START_STEPS + 1,
                          moe=MoeConfig(policy=policy, params=params, cache_slots=args.moe_cache_slots,
                                        cache_rate=args.moe_cache_rate, bw_profile=args.bw_profile),
                          trace=TraceConfig(routing_replay=args.routing_replay))
    started = time.perf_counter()
    runner = ModelRunner(args.model, config, rows=1, pool=pool)
    try:  # closed after: in one process, a policy's CPU threads must not outlive its turn
        _runner_under_loads(args, variant, runner, loads, started)
    finally:
        runner.close()


def _runner_under_loads(args: argparse.Namespace, variant: str, runner, loads: dict, started: float) -> None:
    import torch

    from freetoken.bench.decode import GreedyRows

    cuda = torch.cuda.is_available()
    rows = GreedyRows(runner, 1, args.prompt_tokens)
    for _ in range(args.warmup_tokens):  # graphs captured and the cache warm before the first load
        rows.step()
    # auto: its warm-up and first probe are start-up too (a probe runs the modes it will not
    # choose, which no steady state does): the loads time the choice it serves with, and the
    # probes their changes start
    choice, extra = runner.live_choice, 0
    while choice is not None and (choice.state.probes == 0 or choice.state.probing) and extra < AUTO_START_STEPS:
        rows.step()
        extra += 1
    # Start-up (kernel compiles on a cold cache among it) is not under any load's cap: say what it took.
    _emit({"part": "decode-start", "policy": variant, "seconds": time.perf_counter() - started,
           **({"first_probe_steps": extra} if choice is not None else {})})
    for load, (busy, copy) in loads.items():
        with interference(busy, copy, args.busy_placement):
            # The cap covers the load's warm-up steps too: a frozen step loop is cut short there as well.
            capped = time.perf_counter() + args.cap_s
            warm = 0
            while warm < args.warmup_tokens and time.perf_counter() < capped:
                rows.step()
                warm += 1
            if cuda:
                torch.cuda.synchronize()
            done, started = 0, time.perf_counter()
            while warm == args.warmup_tokens and done < args.decode_tokens and time.perf_counter() < capped:
                rows.step()
                done += 1
            seconds = time.perf_counter() - started
        _emit({"part": "decode", "policy": variant, "load": load, "mode": "graph" if runner.graphs else "eager",
               "warmup_tokens": warm, "tokens": done, "seconds": seconds,
               "tok_per_s": done / seconds if seconds > 0 else 0.0,
               "frozen": done < args.decode_tokens, **_split_record(runner, warm + done)})


def _split_record(runner, steps: int) -> dict:
    """A live split's state at the load's end and its r over the load's steps (warm-up included:
    how it settled after the load changed), its thread count, auto's choice; nothing for a fixed split."""
    record = {}
    split = runner.live_split
    if split is not None:
        status = split.status()
        record["split"] = {k: status[k] for k in ("ratio", "target", "pcie_fill_bytes_per_s", "cpu_expert_bytes_per_s")}
        record["split_trace"] = [[step, r] for step, r in list(split.history)[-steps:]]
    if runner.live_threads is not None:  # the CPU executor's thread count following the live split
        record["cpu_threads"] = runner.live_threads.status()
    if runner.live_choice is not None:  # auto: the modes it ran (since start) and why it last probed
        record["live_policy"] = runner.live_choice.status()
    return record


def _variant(text: str) -> tuple[str, dict[str, str]]:
    """"hybrid" or "hybrid:ratio=0.2+fetch_recurring=off" -> (policy, its --moe-param values)."""
    from freetoken.moe.policy import parse_params

    name, _, params = text.partition(":")
    return name, parse_params(params.split("+")) if params else {}


def _children(args: argparse.Namespace, part: str, timeout: float, env: dict | None = None,
              on_record: Callable[[dict], None] | None = None, **extra) -> list[dict]:
    """Run this script as a child for `part` (with `env` added to its environment); its JSON
    lines, plus a "failed" record if it failed or was killed. `on_record` sees each record as it arrives."""
    cmd = [sys.executable, "-m", "benchmarks.cpu_interference", "--child", part,
           "--busy-placement", args.busy_placement, "--cap-s", str(args.cap_s), "--repeats", str(args.repeats)]
    for key in ("model", "routing_replay", "moe_cache_slots", "moe_cache_rate", "bw_profile", "prompt_tokens",
                "warmup_tokens", "decode_tokens", "loads"):
        value = getattr(args, key)
        if value is not None:
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    for key, value in extra.items():
        cmd += [f"--{key}", str(value)]
    env = {**os.environ, **(env or {})}
    return json_line_records(cmd, timeout, env, on_record, failed_record={"part": part, **extra})


def _median(seconds: list) -> float | None:
    done = [s for s in seconds if s is not None]
    return statistics.median(done) if done and len(done) == len(seconds) else None


def _at_most(ratio: float | None, bound: float) -> dict:
    return {"ratio": ratio, "target": f"<= {bound}", "met": ratio is not None and ratio <= bound}


def _targets(records: list[dict]) -> dict:
    """Each target of issue 28 item 6 that this run measured: the ratio and whether it holds."""
    targets = {}
    demo = [r for r in records if r["part"] == "demo" and "seconds" in r and "omp_wait_policy" not in r]
    quiet = [_median(r["seconds"]) for r in demo if r["load"] == "quiet"]
    busy = [_median(r["seconds"]) for r in demo if r["load"] == "busy1"]
    if quiet:
        # against the faster quiet run: the stricter reading
        ratio = busy[0] / min(quiet) if busy and busy[0] and None not in quiet else None
        targets["demo_busy1_over_quiet"] = _at_most(ratio, 1.5)
    rate = {(r["policy"], r["load"]): r["tok_per_s"] for r in records if r["part"] == "decode" and "tok_per_s" in r}
    # a run that has a record but no rate (frozen, failed, killed) counts as 0; one never started is not measured
    ran = {(r.get("policy"), r.get("load")) for r in records if r["part"] == "decode"}
    if ("hybrid", "quiet") in rate and ("hybrid", "busy1") in ran:
        ratio = rate.get(("hybrid", "busy1"), 0.0) / rate[("hybrid", "quiet")]
        targets["hybrid_busy1_over_quiet"] = {"ratio": ratio, "target": ">= 0.8", "met": ratio >= 0.8}
    for load in ("busy4", "copy", "busy4+copy"):
        if ("transfer", load) in rate and ("hybrid", load) in ran:
            ratio = rate.get(("hybrid", load), 0.0) / rate[("transfer", load)]
            targets[f"hybrid_over_transfer_{load}"] = {"ratio": ratio, "target": ">= 1", "met": ratio >= 1.0}
    targets.update(_split_targets(rate))
    pools = [r for r in records if r["part"] == "pool" and "fill_s" in r]
    quiet = [r["fill_s"] + r["pin_s"] for r in pools if r["load"] == "quiet"]
    busy = [r["fill_s"] + r["pin_s"] for r in pools if r["load"] == "busy1"]
    if quiet:
        ratio = busy[0] / min(quiet) if busy else None
        targets["pool_busy1_over_quiet"] = _at_most(ratio, 1.5)
    return targets


LIVE_HYBRID = "hybrid:adaptive=true"  # the split the engine's own timings move
STATIC_HYBRID = "hybrid:adaptive=false"  # the profile's split throughout


def _split_targets(rate: dict) -> dict:
    """Issue 34's targets this run measured: the live split (LIVE_HYBRID) against the profile's
    (STATIC_HYBRID), quiet within 2% and >= 1.15x under each load, and >= the better of
    transfer and cpu under the same load; auto within 5% of the best of them all under each load."""
    targets = {}
    for load in LOADS:
        live, static = rate.get((LIVE_HYBRID, load)), rate.get((STATIC_HYBRID, load))
        if live is None or not static:
            continue
        bound = 0.98 if load == "quiet" else 1.15
        targets[f"live_over_static_hybrid_{load}"] = {"ratio": live / static, "target": f">= {bound}",
                                                      "met": live / static >= bound}
        others = [rate[(p, load)] for p in ("transfer", "cpu") if (p, load) in rate]
        if load != "quiet" and others:
            targets[f"live_hybrid_over_best_single_path_{load}"] = {
                "ratio": live / max(others), "target": ">= 1", "met": live >= max(others)}
    for load in LOADS:  # auto against the best of transfer, either hybrid and cpu under the same load
        auto = rate.get(("auto", load))
        best = max((rate[(p, load)] for p in ("transfer", "cpu", LIVE_HYBRID, STATIC_HYBRID) if (p, load) in rate),
                   default=None)
        if auto is not None and best:
            targets[f"auto_over_best_{load}"] = {"ratio": auto / best, "target": ">= 0.95", "met": auto >= 0.95 * best}
    return targets


def _machine() -> dict:
    from freetoken.kernels.cpu.bandwidth import cpu_model, physical_cores

    return {"cpu": cpu_model(), "cpus_allowed": len(os.sched_getaffinity(0)), "physical_cores": physical_cores(),
            "load_average_at_start": os.getloadavg()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--model", default=None, help="checkpoint directory (CUDA part); without it: the CPU part")
    p.add_argument("--routing-replay", default=None)
    p.add_argument("--moe-cache-slots", type=int, default=None)
    p.add_argument("--moe-cache-rate", type=float, default=None)
    p.add_argument("--bw-profile", default=None)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--warmup-tokens", type=int, default=8, help="steps before each load's timed ones")
    p.add_argument("--decode-tokens", type=int, default=24, help="timed steps per load")
    p.add_argument("--repeats", type=int, default=5, help="demo requests per load")
    p.add_argument("--cap-s", type=float, default=10.0,
                   help="a load's steps (or demo request) stop here, and the load counts as frozen")
    p.add_argument("--start-s", type=float, default=300.0,
                   help="a decode child's start-up allowance (a cold kernel cache compiles for minutes)")
    p.add_argument("--busy-placement", choices=["pinned", "free"], default="pinned")
    p.add_argument("--policies", default="hybrid,transfer",
                   help="decode policies in turn; a variant adds --moe-param values: "
                        "hybrid:ratio=0.2+fetch_recurring=off")
    p.add_argument("--loads", default=",".join(LOADS), help=f"decode loads, of: {', '.join(LOADS)}")
    p.add_argument("--no-pool", dest="pool", action="store_false", help="skip the pool fill and pin part")
    p.add_argument("--one-process", action="store_true",
                   help="every policy in one child over one pinned pool (loads the pool once)")
    p.add_argument("--fresh-numba-cache", action="store_true",
                   help="CUDA part: each decode child compiles into an empty Numba cache of its own")
    p.add_argument("--compare-active-wait", action="store_true",
                   help="CPU part: the demo also with OpenMP's own idle spin (what freetoken replaces), for comparison")
    p.add_argument("--child", choices=["demo", "pool", "decode"], help=argparse.SUPPRESS)
    p.add_argument("--policy", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        {"demo": child_demo, "pool": child_pool, "decode": child_decode}[args.child](args)
        return 0
    started = time.perf_counter()
    machine = _machine()
    records: list[dict] = []

    def write_report() -> str:
        """The report so far, written after every record: a run cut short keeps what it measured."""
        report = {
            "command": " ".join(["python -m benchmarks.cpu_interference", *sys.argv[1:]]),
            "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "machine": machine,
            "busy_placement": args.busy_placement,
            "records": records,
            "load_average_at_end": os.getloadavg(),  # other work on the machine, beside what this run started
            "targets": _targets(records),
            "wall_s": time.perf_counter() - started,
        }
        text = json.dumps(report, indent=1)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text + "\n")
        return text

    def keep_and_report(record: dict) -> None:
        """A decode record as its child prints it: into the report at once, and into the log."""
        records.append(record)
        write_report()
        print(json.dumps(record), file=sys.stderr, flush=True)

    if args.model is None:
        records += _children(args, "demo", timeout=60 + 3 * args.repeats * args.cap_s)
        write_report()
        if args.compare_active_wait:
            # The OpenMP runtime's own default (idle threads spin ~3 ms), which freetoken replaces.
            records += [{**r, "omp_wait_policy": "ACTIVE-default"} for r in _children(
                args, "demo", timeout=60 + 3 * args.repeats * args.cap_s, env={"GOMP_SPINCOUNT": "300000"})]
    else:
        # one child per policy (a freeze costs only its own), or one for all (--one-process: one pool load)
        groups = [args.policies] if args.one_process else args.policies.split(",")
        for group in groups:
            env = {"NUMBA_CACHE_DIR": tempfile.mkdtemp(prefix="numba-")} if args.fresh_numba_cache else None
            timeout = len(group.split(",")) * (args.start_s + len(LOADS) * (args.cap_s + 5))
            _children(args, "decode", timeout=timeout, env=env, on_record=keep_and_report, policy=group)
        for load in ("quiet", "busy1", "quiet") if args.pool else ():  # quiet twice: the first also reads the file
            busy, _ = LOADS[load]
            with interference(busy, False, args.busy_placement):
                records += [{**r, "load": load} for r in _children(args, "pool", timeout=120)]
            write_report()
    print(write_report())
    return 0

if __name__ == "__main__":
    sys.exit(main())
