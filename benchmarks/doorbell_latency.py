"""The CPU branch's cost per MoE layer as a captured decode step sees it: ring to done.

    python -m benchmarks.doorbell_latency --out doorbell-latency.json [--pollers team,per-call]

A compiled "ringer" thread plays the GPU's part of the doorbell (kernels/cpu/doorbell.py): it
waits `--gap-us` (a layer's GPU work between two rings), writes one token's expert ids into
the mailbox, rings, and spins until done, timing ring to done with the cycle counter. The
executor answers with the poller under test, as in decode. Each call reads experts no call
has read since the whole pool went by (cold from DRAM, as in decode). The ring-to-done time
is what a lone CPU expert costs the step's critical path, before any GPU-side hand-off; the
poller's own kernel span (its stamps) tells the handshake from the kernel.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time

import numpy as np
from numba import njit

from benchmarks.cpu_experts_probe import build_banks, cpu_run_header
from freetoken.bench.bw import expert_calls
from freetoken.kernels.cpu.bandwidth import kernel_threads
from freetoken.kernels.cpu.doorbell import (
    ABORT,
    BELL,
    DONE,
    _cycles,
    _load_acquire,
    _store_release,
    cycles_now,
)
from freetoken.kernels.cpu.executor import CpuExpertExecutor
from freetoken.kernels.cpu.mailbox import Mailbox

HIDDEN, INTER, TOP_K = 2048, 768, 8  # qwen3-30b-a3b


@njit(nogil=True)
def ring_calls(flags, fids, calls, gap_cycles, latency):
    """Ring once per row of calls [n, K] (ids of one token), `gap_cycles` apart; latency [n]
    receives ring-to-done cycles. Returns the calls completed (fewer on abort)."""
    for c in range(calls.shape[0]):
        t0 = _cycles()
        while _cycles() - t0 < gap_cycles:
            pass
        fids[0, :] = calls[c]
        start = _cycles()
        bell = 1 | ((c + 1) << 16)  # one row, layer field c + 1
        _store_release(flags, BELL, bell)
        while _load_acquire(flags, DONE) != bell:  # the poller echoes the bell value
            if _load_acquire(flags, ABORT) != 0:
                return c
        latency[c] = _cycles() - start
    return calls.shape[0]


def cycles_per_us() -> float:
    c0, t0 = int(cycles_now()), time.perf_counter()
    time.sleep(0.2)
    return (int(cycles_now()) - c0) / ((time.perf_counter() - t0) * 1e6)


def measure(executor, mailbox, calls: np.ndarray, gap_cycles: int, rate: float) -> dict:
    latency = np.zeros(calls.shape[0], np.int64)
    ticket = executor.serve(mailbox, calls.shape[0], calls.shape[0])  # the last call's layer field: calls
    done: list[int] = []
    ringer = threading.Thread(target=lambda: done.append(ring_calls(mailbox.flags, mailbox.fids, calls,
                                                                    gap_cycles, latency)))
    ringer.start()
    mailbox.finish(ticket, drained=lambda: bool(done), timeout=120)
    ringer.join()
    warm = 5  # the first rings warm the team and the code
    ring_us = latency[warm:] / rate
    span_us = (ticket.out[warm:, 1] - ticket.out[warm:, 0]) / rate
    return {"median_us": float(np.median(ring_us)), "p90_us": float(np.percentile(ring_us, 90)),
            "kernel_span_median_us": float(np.median(span_us)),
            "handshake_median_us": float(np.median(ring_us - span_us))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pollers", default="team,per-call")
    p.add_argument("--experts", default="0,1,2,4,8", help="experts per ring (0: an empty ring)")
    p.add_argument("--gaps-us", default="100,1000", help="GPU time between rings, comma-separated")
    p.add_argument("--pool", type=int, default=512, help="experts in the bank (512: 4.8 GB)")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--threads", type=int, default=None, help="executor threads (default: the executor's)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    w13, w2 = build_banks(args.pool, HIDDEN, INTER)
    rate = cycles_per_us()
    rng = np.random.default_rng(0)
    rows = []
    for poller in args.pollers.split(","):
        with CpuExpertExecutor(w13, w2, args.threads, poller=poller) as executor:
            mailbox = Mailbox(1, TOP_K, HIDDEN, pinned=False)
            mailbox.x[:] = rng.standard_normal((1, HIDDEN), dtype=np.float32)
            mailbox.weights[:] = 1.0 / TOP_K
            mailbox.compile_poller(executor)
            for count in (int(c) for c in args.experts.split(",")):
                for gap in (float(g) for g in args.gaps_us.split(",")):
                    calls = np.full((args.calls + 5, TOP_K), -1, np.int32)
                    if count:
                        chosen = expert_calls(rng, args.pool, count, 1, args.calls + 5)
                        calls[:, :count] = np.concatenate(chosen)
                    row = {"poller": executor.poller, "experts": count, "gap_us": gap,
                           **measure(executor, mailbox, calls, int(gap * rate), rate)}
                    rows.append(row)
                    print(f"{poller:8s} {count} experts, gap {gap:6.0f} us: ring to done {row['median_us']:7.1f} us "
                          f"(p90 {row['p90_us']:7.1f}), kernel {row['kernel_span_median_us']:7.1f}", file=sys.stderr)
    result = {
        **cpu_run_header(f"python -m benchmarks.doorbell_latency {shlex.join(sys.argv[1:] if argv is None else argv)}",
                         args.threads or kernel_threads()),
        "expert_bytes": int(w13[0].nbytes + w2[0].nbytes), "pool_experts": args.pool, "calls": args.calls,
        "results": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
