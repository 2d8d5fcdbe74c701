"""`python -m freetoken bench bw`: the bandwidths the hybrid split is decided by.

Measures, on the machine at hand, for experts of one shape (default qwen3-30b-a3b: H 2048,
I 768, top-8, batch 1) in each format asked for (`--format`: bf16, a GGML block type, a file mix
such as Q4_K_M, or gpt-oss's mxfp4+bias; moe/profile_key.py names them, bench/bw_banks.py builds
their random banks):
 1. the CPU memory-read ceiling (Numba probe);
 2. the pinned host->GPU copy ceiling (one large copy; expert-sized copies);
 3. the format's real CPU expert kernel (kernels/cpu/cpu_kernel.py) on `top_k` distinct random
    experts per call, drawn so that no expert comes back before the whole pool (several times
    the last-level cache) has passed: expert bytes per second from DRAM, as in decode, where every layer's experts
    are other bytes (a 300 MB L3 otherwise doubles the figure);
 4. the real slot fill: per-expert copies from pinned host banks into GPU slot banks on a
    side stream: bytes per second;
 5. 3 and 4 at the same time, since both read host memory through one memory controller.
Rates are bytes of the format's experts (its banks' rows, as the slots hold them) per second.
gpt-oss's shapes are passed explicitly, e.g. 120b: --format mxfp4+bias --hidden 2880
--intermediate 2880 --top-k 4 --experts 128 (MXFP4 needs H and I multiples of 32).
The result is one profile per format, stored in a JSON file of profiles keyed by GPU name and
the format's profile key (freetoken/moe/bandwidth_profile.py, whose `load_ratio` reads the pair
the q* split needs: the concurrent pair when measured).
Without CUDA, 2, 4 and 5 are skipped (noted in the profile) and 3 still runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from freetoken.moe.bandwidth_profile import DEFAULT_PROFILE_PATH, NO_GPU, save_profile
from freetoken.moe.profile_key import ACCEPTED, UNQUANTIZED_KEY, canonical_key

log = logging.getLogger(__name__)


def add_bench_bw_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", dest="formats", action="append", default=None, metavar="F",
                   help="expert format to measure, repeatable or comma-separated (default bf16): "
                        + ", ".join(ACCEPTED) + "; for mxfp4+bias (gpt-oss) give the model's shape, e.g. "
                        "120b: --hidden 2880 --intermediate 2880 --top-k 4 --experts 128")
    p.add_argument("--hidden", type=int, default=2048, help="H (default: qwen3-30b-a3b)")
    p.add_argument("--intermediate", type=int, default=768, help="expert intermediate size I")
    p.add_argument("--top-k", type=int, default=8, help="distinct experts per kernel call / per fill")
    p.add_argument("--experts", type=int, default=256,
                   help="experts in the random host pool (keep it several times the last-level cache)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU kernel threads (default: physical cores but one, as the executor uses)")
    p.add_argument("--repeats", type=int, default=50, help="timed calls per measurement (median)")
    p.add_argument("--read-mib", type=int, default=1024, help="buffer size of the CPU read probe")
    p.add_argument("--out", default=str(DEFAULT_PROFILE_PATH), help="profile file to update")
    p.add_argument("--json", action="store_true",
                   help="print the profile as JSON on stdout (a list of them, one per format, for several)")


def run_bench_bw(args: argparse.Namespace) -> int:
    try:
        formats = format_keys(args.formats)
    except ValueError as err:
        print(f"bench bw: --format: {err}", file=sys.stderr)
        return 2
    profiles = []
    for key in formats:
        try:
            profile = measure(
                hidden=args.hidden, intermediate=args.intermediate, top_k=args.top_k, experts=args.experts,
                threads=args.threads, repeats=args.repeats, read_bytes=args.read_mib << 20,
                command=_command(args, key), expert_format=key,
            )
        except ValueError as err:  # a shape the format cannot hold, too few experts
            print(f"bench bw --format {key}: {err}", file=sys.stderr)
            return 2
        path = save_profile(args.out, profile)
        print(_summary(profile, path), file=sys.stderr)
        profiles.append(profile)
    if args.json:
        print(json.dumps(profiles[0] if len(profiles) == 1 else profiles, indent=2))
    return 0


def format_keys(values: list[str] | None) -> list[str]:
    """--format's values (repeated, comma-separated) -> profile keys in order, once each; bf16 when
    none. ValueError naming a value that is no format."""
    keys = [canonical_key(v) for value in values or [UNQUANTIZED_KEY] for v in value.split(",") if v.strip()]
    if not keys:
        raise ValueError(f"no format given; accepted: {', '.join(ACCEPTED)}")
    return list(dict.fromkeys(keys))


def measure(hidden: int, intermediate: int, top_k: int, experts: int, threads: int | None,
            repeats: int, read_bytes: int, command: str = "", expert_format: str = UNQUANTIZED_KEY) -> dict[str, Any]:
    """Run the five measurements on random experts in `expert_format` (a profile key); returns
    the profile (bytes per second throughout)."""
    import numba
    import numpy as np

    from freetoken.bench.bw_banks import random_banks
    from freetoken.kernels.cpu.bandwidth import (
        check_threading,
        cpu_model,
        kernel_threads,
        last_level_cache_bytes,
        physical_cores,
        read_bandwidth,
        set_threads,
    )
    from freetoken.kernels.cpu.cpu_kernel import kernel_for

    expert_format = canonical_key(expert_format)
    if top_k > experts:
        raise ValueError(f"--top-k {top_k} needs at least as many --experts (got {experts})")
    threads = set_threads(kernel_threads() if threads is None else threads)
    cuda = _cuda()
    notes: list[str] = []
    gpu = cuda.get_device_name(0) if cuda else NO_GPU
    if not cuda:
        notes.append("no CUDA device: H2D, slot fill and concurrent measurements skipped")
    rng = np.random.default_rng(0)
    w13, w2, w13_t, w2_t, layout = random_banks(rng, expert_format, experts, hidden, intermediate, pinned=bool(cuda))
    kernel = kernel_for(w13, w2, layout)
    expert_bytes = w13[0].nbytes + w2[0].nbytes
    llc = last_level_cache_bytes()
    if llc and experts * expert_bytes < 4 * llc:
        notes.append(f"expert pool {experts * expert_bytes / 1e6:.0f} MB is under 4x the last-level cache "
                     f"({llc / 1e6:.0f} MB): cache hits may inflate the CPU figure")
        log.warning("bench bw: %s", notes[-1])
    calls = expert_calls(rng, experts, top_k, 1, max(repeats, 1))

    profile: dict[str, Any] = {"gpu": gpu, "expert_format": expert_format}
    profile["cpu_read_Bps"] = read_bandwidth(read_bytes, physical_cores()) * 1e9
    cpu_time = _time_cpu_experts(kernel, calls, threads)
    profile["cpu_expert_Bps"] = top_k * expert_bytes / statistics.median(cpu_time)
    profile["pcie_fill_Bps"] = None
    profile["concurrent"] = None
    profile["h2d_pinned_Bps"] = None
    if cuda:
        profile["h2d_pinned_Bps"], profile["h2d_pinned_expert_Bps"] = _h2d_rates(expert_bytes, repeats)
        fill = _SlotFill(w13_t, w2_t, top_k)
        profile["pcie_fill_Bps"] = fill.rate(calls)
        fill_calls = expert_calls(rng, experts, top_k, 1, 4 * len(calls))
        profile["concurrent"] = _concurrent(fill, fill_calls, kernel, calls, threads)
    profile["shape"] = {"hidden": hidden, "intermediate": intermediate, "top_k": top_k, "batch": 1,
                        "experts": experts, "expert_bytes": expert_bytes}
    profile["machine"] = {
        "cpu": cpu_model(), "physical_cores": physical_cores(), "logical_cpus": len(os.sched_getaffinity(0)),
        "threads": threads, "last_level_cache_bytes": llc, "numba_threading_layer": check_threading(),
        "python": platform.python_version(),
        "numba": numba.__version__, "numpy": np.__version__, "torch": _torch_version(),
        "platform": platform.platform(),
    }
    profile["notes"] = notes
    profile["command"] = command
    profile["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return profile


def expert_calls(rng, experts: int, top_k: int, batch: int, count: int) -> list:
    """ids [batch, top_k] (int64) for `count` calls: each call's tokens pick top_k distinct
    experts from a fresh window of top_k * batch experts of a random permutation of the pool, so
    an expert returns only after the whole pool has been read (no last-level cache hits when
    the pool is several times that cache)."""
    import numpy as np

    window = top_k * batch
    if window > experts:
        raise ValueError(f"{experts} experts cannot give {batch} tokens x top-{top_k} fresh experts per call")
    order = np.empty(0, np.int64)
    calls = []
    for _ in range(count):
        if order.size < window:
            order = rng.permutation(experts)
        win, order = order[:window], order[window:]
        calls.append(np.stack([rng.choice(win, top_k, replace=False) for _ in range(batch)]).astype(np.int64))
    return calls


def _command(args: argparse.Namespace, expert_format: str) -> str:
    """The command line that reproduces this measurement, every knob spelled out."""
    parts = ["python", "-m", "freetoken", "bench", "bw", "--format", expert_format, "--hidden", args.hidden,
             "--intermediate",
             args.intermediate, "--top-k", args.top_k, "--experts", args.experts, "--repeats", args.repeats,
             "--read-mib", args.read_mib, "--out", args.out]
    if args.threads is not None:
        parts += ["--threads", args.threads]
    return shlex.join(str(p) for p in parts)


def _cuda():
    """torch.cuda when a CUDA device is usable, else None (torch is imported only here)."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda if torch.cuda.is_available() else None


def _torch_version() -> str | None:
    torch = sys.modules.get("torch")
    return getattr(torch, "__version__", None)


def _time_cpu_experts(kernel, calls, threads: int) -> list[float]:
    """Seconds per CPU kernel call, one token routed to each call's experts."""
    import numpy as np

    from freetoken.kernels.cpu.bandwidth import set_threads

    set_threads(threads)
    x, weights, out = _token(kernel.hidden, calls[0].shape[1])
    kernel.run(x, weights, np.full_like(calls[0], -1), out)  # compile / load, touching no expert
    times = []
    for ids in calls:
        t0 = time.perf_counter()
        kernel.run(x, weights, ids, out)
        times.append(time.perf_counter() - t0)
    return times


def _token(hidden: int, top_k: int):
    import numpy as np

    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, hidden), dtype=np.float32)
    weights = np.full((1, top_k), 1.0 / top_k, np.float32)
    return x, weights, np.empty_like(x)


def _h2d_rates(expert_bytes: int, repeats: int) -> tuple[float, float]:
    """Pinned host->GPU: one 1 GiB copy (median of 5), and 32 separate expert-sized copies."""
    import torch

    size = 1 << 30
    src = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    big = statistics.median(_events(lambda: dst.copy_(src, non_blocking=True)) for _ in range(5))
    n = min(32, size // expert_bytes)

    def experts() -> None:
        for j in range(n):
            dst[j * expert_bytes:(j + 1) * expert_bytes].copy_(src[j * expert_bytes:(j + 1) * expert_bytes],
                                                               non_blocking=True)

    small = statistics.median(_events(experts) for _ in range(max(3, min(repeats, 10))))
    return size / big, n * expert_bytes / small


def _events(fn) -> float:
    """Seconds of GPU stream time that fn's queued work takes (CUDA events)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


class _SlotFill:
    """GPU slot banks for top_k experts, filled from the pinned host banks on a side stream."""

    def __init__(self, w13_t, w2_t, top_k: int) -> None:
        import torch

        self.torch = torch
        self.host = (w13_t, w2_t)
        self.slots = tuple(torch.empty((top_k, *t.shape[1:]), dtype=t.dtype, device="cuda")
                           for t in self.host)  # [top_k, 2I, H], [top_k, H, I]
        self.stream = torch.cuda.Stream()
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in self.host)

    def fill(self, ids) -> None:
        for slot, fid in enumerate(ids.reshape(-1).tolist()):
            for bank, host in zip(self.slots, self.host, strict=True):
                bank[slot].copy_(host[fid], non_blocking=True)

    def run(self, calls) -> tuple[float, float]:
        """(start, end) perf_counter times of filling every call's experts back to back."""
        with self.torch.cuda.stream(self.stream):
            self.fill(calls[0])  # warm-up
            self.stream.synchronize()
            t0 = time.perf_counter()
            for fids in calls:
                self.fill(fids)
            self.stream.synchronize()
        return t0, time.perf_counter()

    def rate(self, calls) -> float:
        t0, t1 = self.run(calls)
        return sum(c.size for c in calls) * self.expert_bytes / (t1 - t0)


def _concurrent(fill: _SlotFill, fill_calls, kernel, calls, threads: int) -> dict[str, float] | None:
    """Fills on this thread while the CPU kernel runs in a loop on another; each rate is taken
    over the window in which both ran."""
    from freetoken.kernels.cpu.bandwidth import set_threads

    x, weights, out = _token(kernel.hidden, calls[0].shape[1])
    spans: list[tuple[float, float]] = []
    stop = threading.Event()
    started = threading.Event()

    def cpu_loop() -> None:
        set_threads(threads)
        j = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            kernel.run(x, weights, calls[j % len(calls)], out)
            spans.append((t0, time.perf_counter()))
            started.set()
            j += 1

    worker = threading.Thread(target=cpu_loop, name="bench-cpu-experts", daemon=True)
    worker.start()
    started.wait()
    w0, w1 = fill.run(fill_calls)
    stop.set()
    worker.join()
    inside = [(a, b) for a, b in spans if a >= w0 and b <= w1]
    if len(inside) < 2:
        log.warning("concurrent measurement: only %d kernel calls inside the fill window", len(inside))
        return None
    cpu_bytes = len(inside) * calls[0].size * fill.expert_bytes
    return {
        "cpu_expert_Bps": cpu_bytes / (inside[-1][1] - inside[0][0]),
        "pcie_fill_Bps": sum(c.size for c in fill_calls) * fill.expert_bytes / (w1 - w0),
    }


def _summary(p: dict[str, Any], path: Path) -> str:
    def gbs(v: float | None) -> str:
        return "skipped" if v is None else f"{v / 1e9:.1f} GB/s"

    conc = p.get("concurrent") or {}
    s = p["shape"]
    lines = [
        f"bench bw: {p['gpu']}, {p['expert_format']} experts H {s['hidden']} I {s['intermediate']} "
        f"({s['expert_bytes'] / 1e6:.1f} MB), top-{s['top_k']}, batch 1, {p['machine']['threads']} threads",
        f"  CPU read ceiling        {gbs(p['cpu_read_Bps'])}",
        f"  H2D pinned ceiling      {gbs(p['h2d_pinned_Bps'])}",
        f"  CPU expert kernel       {gbs(p['cpu_expert_Bps'])}",
        f"  slot fill (PCIe)        {gbs(p['pcie_fill_Bps'])}",
        f"  concurrent CPU / PCIe   {gbs(conc.get('cpu_expert_Bps'))} / {gbs(conc.get('pcie_fill_Bps'))}",
        *(f"  note: {n}" for n in p["notes"]),
        f"  saved to {path}",
    ]
    return "\n".join(lines)
