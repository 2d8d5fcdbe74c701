"""How long a decode step's small device-to-host reads take, quiet and beside another process's
pinned host-to-device copies (the contention run's `copy` load): a `.tolist()` (a copy-engine
transfer) against `HostReadback.read` (a kernel's stores into pinned memory, then an event
wait), and a logits-sized device-to-device clone against a kernel computing the same copy.

    python -m benchmarks.readback_probe --out FILE.json

Each case: a tiny kernel first (so the read waits on real work, as after a step), then the
read; medians and 90th percentiles over --reps reads, in microseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _time_us(fn, reps: int) -> dict:
    import torch

    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    samples.sort()
    return {"median_us": round(statistics.median(samples), 1), "p90_us": round(samples[int(0.9 * len(samples))], 1)}


def _cases(vocab: int) -> dict:
    import torch

    from freetoken.engine.host_readback import HostReadback

    token = torch.zeros(1, dtype=torch.int64, device="cuda")
    logits = torch.randn(1, vocab, device="cuda")
    readback = HostReadback()
    done = torch.cuda.Event()

    def step_then(read):
        def run():
            token.add_(1)  # the work the read waits for
            return read()
        return run

    def synced(make):
        def run():
            make()
            done.record()
            done.synchronize()
        return run

    return {
        "event_wait_only": step_then(synced(lambda: None)),
        "tolist": step_then(lambda: token.tolist()),
        "host_readback": step_then(lambda: readback.read(token)),
        "clone_logits": step_then(synced(lambda: logits.clone())),
        "kernel_copy_logits": step_then(synced(lambda: torch.neg(logits).neg_())),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--vocab", type=int, default=201088, help="logits row width (gpt-oss's vocabulary)")
    parser.add_argument("--loads", default="quiet,copy", help="comma list of quiet, copy")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("readback_probe needs a CUDA device")
    from benchmarks.cpu_interference import LOADS, interference

    cases = _cases(args.vocab)
    for fn in cases.values():  # compile and warm
        fn()
    results = {}
    for load in args.loads.split(","):
        busy, copy = LOADS[load]
        with interference(busy, copy, "free"):
            time.sleep(0.5)  # (the copy loop running)
            results[load] = {name: _time_us(fn, args.reps) for name, fn in cases.items()}
        print(load, json.dumps(results[load]), flush=True)
    record = {"gpu": torch.cuda.get_device_name(), "reps": args.reps, "vocab": args.vocab, "results": results}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
