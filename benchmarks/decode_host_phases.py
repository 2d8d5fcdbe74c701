"""Where a graph-mode decode step's host time goes: `bench decode` with host timestamps around
the calls a captured step makes, per policy.

    python -m benchmarks.decode_host_phases OUT.json bench decode --model M ... --modes graph

Per decode step (medians and means over the timed steps, microseconds):
- prep: from `DecodeGraphs.decode` entered to `CUDAGraph.replay` called (inputs, KV view, mailbox
  arming, the poller queued; the device idles through it unless the last step is still running);
- replay: the `replay()` call itself (graph launch);
- serve: `CpuExpertExecutor.serve` (queueing the poller), arm: `Mailbox.arm`, inputs:
  `StepInputs.fill` (the step's inputs into the pinned buffer), routing_stage: `RoutingHook.stage`
  (replayed routing: the step's ids drawn); with the inputs made before it,
  kv_view: `KVCache.view`, copy_N: the Nth `Tensor.copy_` inside `decode` (the inputs to the
  device); all part of prep;
- finish: `Mailbox.finish` (the wait for the poller's ticket), and ring_to_wake, from the worker
  ringing the ticket to `finish` returning on the caller's thread;
- after: `decode` returning to the next `decode` entered (the bench's argmax and its
  synchronisation, Python between steps); of it, sync: the bench's `tolist()` of the sampled
  tokens (waiting for the device), and between: from that returning to the next `decode`
  entered (the bench's Python, the events recorded).
The wrappers cost about a microsecond each. The results file holds `bench decode`'s results and
these phases; the timings are host-side only, and the device's are in `bench decode`'s
`device_ms_per_step`.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


class Phases:
    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}
        self.marks: dict[str, int] = {}

    def add(self, name: str, ns: int) -> None:
        self.samples.setdefault(name, []).append(ns / 1e3)

    def summary(self) -> dict:
        return {k: {"median_us": statistics.median(v), "mean_us": statistics.fmean(v), "n": len(v)}
                for k, v in self.samples.items() if v}


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1:3] != ["bench", "decode"]:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out_path, bench_argv = argv[0], argv[1:]
    import torch

    from freetoken.__main__ import main as freetoken_main
    from freetoken.bench import decode as bench_decode
    from freetoken.engine.decode_graphs import DecodeGraphs
    from freetoken.kernels.cpu.executor import CpuExpertExecutor, Ticket
    from freetoken.kernels.cpu.mailbox import Mailbox
    from freetoken.models.kv_cache import KVCache

    now = time.perf_counter_ns
    state = {"phases": Phases(), "per_policy": {}}

    def timed(cls, name, before=None, after=None):
        original = getattr(cls, name)

        def wrapper(*a, **kw):
            t0 = now()
            if before:
                before(t0)
            try:
                return original(*a, **kw)
            finally:
                t1 = now()
                if after:
                    after(t0, t1)
        setattr(cls, name, wrapper)
        return cls, name, original

    ph = lambda: state["phases"]  # noqa: E731

    def decode_before(t0):
        p = ph()
        if "decode_exit" in p.marks:
            p.add("after", t0 - p.marks["decode_exit"])
        if "tolist_exit" in p.marks:
            p.add("between", t0 - p.marks.pop("tolist_exit"))
        p.marks["decode_enter"] = t0
        p.marks["copies"] = 0

    def decode_after(t0, t1):
        p = ph()
        p.marks["decode_exit"] = t1
        p.marks.pop("copies", None)
        p.add("decode", t1 - t0)

    def replay_before(t0):
        p = ph()
        if "decode_enter" in p.marks:
            p.add("prep", t0 - p.marks["decode_enter"])

    def copy_after(t0, t1):
        p = ph()
        if "copies" in p.marks:  # inside decode
            p.add(f"copy_{p.marks['copies']}", t1 - t0)
            p.marks["copies"] += 1

    def tolist_after(t0, t1):
        p = ph()
        if "decode_exit" in p.marks and "copies" not in p.marks:  # the bench's, between steps
            p.add("sync", t1 - t0)
            p.marks["tolist_exit"] = t1

    def ring_before(t0):
        ph().marks["rung"] = t0

    def finish_after(t0, t1):
        p = ph()
        p.add("finish", t1 - t0)
        if "rung" in p.marks:
            p.add("ring_to_wake", t1 - p.marks.pop("rung"))

    try:
        from freetoken.engine.step_inputs import StepInputs
    except ImportError:  # a tree from before them (an A/B)
        StepInputs = None
    from freetoken.engine.routing_hook import RoutingHook

    patches = [] if StepInputs is None else [
        timed(StepInputs, "fill", None, lambda t0, t1: ph().add("inputs", t1 - t0))]
    patches.append(timed(RoutingHook, "stage", None, lambda t0, t1: ph().add("routing_stage", t1 - t0)))
    patches += [
        timed(DecodeGraphs, "decode", decode_before, decode_after),
        timed(torch.cuda.CUDAGraph, "replay", replay_before, lambda t0, t1: ph().add("replay", t1 - t0)),
        timed(CpuExpertExecutor, "serve", None, lambda t0, t1: ph().add("serve", t1 - t0)),
        timed(Mailbox, "arm", None, lambda t0, t1: ph().add("arm", t1 - t0)),
        timed(Mailbox, "finish", None, finish_after),
        timed(Ticket, "_ring", ring_before),
        timed(KVCache, "view", None, lambda t0, t1: ph().add("kv_view", t1 - t0)),
        timed(torch.Tensor, "copy_", None, copy_after),
        timed(torch.Tensor, "tolist", None, tolist_after),
    ]
    run_policy = bench_decode._run_policy

    def run_policy_phases(args, policy, *a, **kw):
        state["phases"] = Phases()
        result = run_policy(args, policy, *a, **kw)
        # the timed steps are the last decode_tokens calls (the warm-up and capture steps come first)
        keep = args.decode_tokens
        p = state["phases"]
        for name, values in p.samples.items():
            p.samples[name] = values[-keep:]
        state["per_policy"].setdefault(policy, []).append(
            {"phases": p.summary(), "tok_per_s": result["tok_per_s"],
             "device_ms_per_step": result.get("device_ms_per_step"),
             "non_kernel_overhead": result.get("non_kernel_overhead")})
        return result

    bench_decode._run_policy = run_policy_phases
    try:
        rc = freetoken_main(bench_argv)
    finally:
        bench_decode._run_policy = run_policy
        for cls, name, original in patches:
            setattr(cls, name, original)
    doc = {"command": "python -m benchmarks.decode_host_phases " + " ".join(argv),
           "what": "host time of graph-mode decode steps, per phase (see the script's docstring)",
           "policies": state["per_policy"]}
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=2)
    for policy, runs in state["per_policy"].items():
        for run in runs:
            cells = "  ".join(f"{k} {v['median_us']:.1f}" for k, v in run["phases"].items())
            print(f"{policy:9s} {run['tok_per_s']:7.1f} tok/s  median us: {cells}")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
