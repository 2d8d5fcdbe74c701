"""The graph-mode slot fill (a kernel pulling pinned host memory over PCIe) at decode's sizes.

    python -m benchmarks.slot_fill_probe --out slot-fill-probe.json [--programs 64,128,256,512]
        [-- BENCH DECODE ARGS]

`bench bw` times the slot fill as DMA copies (`fill_slots_copies`); captured decode steps use
`fill_slots`, whose programs read the host banks in place. This times one, two and four experts
of the qwen3-30b-a3b shape per fill, planned as decode plans them (N*K entries, the rest -1),
at several program counts per copy, against one DMA copy per expert. Arguments after `--` run
`bench decode` once per program count, in this process, so the engine's decode is timed at each.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys

import torch

from freetoken.kernels.triton import slot_fill

HIDDEN, INTER, TOP_K = 2048, 768, 8  # qwen3-30b-a3b


def _time(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats * 1e3  # us


def _kernel_fill(count, plan_slots, plan_fids, host, slots, pool):
    """A fill of `count` experts the pool has not just sent (each call moves the window on)."""
    step = [0]

    def fill():
        step[0] = (step[0] + count) % (pool - count)
        plan_fids[:count] = torch.arange(step[0], step[0] + count, dtype=torch.int32, device="cuda")
        slot_fill.fill_slots(plan_slots, plan_fids, host, slots)

    return fill


def probe_arguments(argv: list[str] | None, doc: str, programs: str, pool: int, pool_help: str):
    """A fill probe's own arguments (before `--`) and the `bench decode` ones after it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    decode_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--programs", default=programs)
    p.add_argument("--pool", type=int, default=pool, help=pool_help)
    p.add_argument("--out", required=True)
    return argv, p.parse_args(own), decode_args


def decode_at_each_count(decode_args: list[str], out: str, counts, constant: str, what: str) -> None:
    """`bench decode` in this process once per program count, with slot_fill's `constant` set
    to it (the graphs read it at capture); results next to `out` as OUT-decode-COUNT.json."""
    from freetoken.__main__ import main as cli

    default = getattr(slot_fill, constant)
    for count in counts:
        setattr(slot_fill, constant, count)
        print(f"[probe] bench decode, {what} at {count} programs a copy", file=sys.stderr)
        sys.argv = ["freetoken", "bench", "decode", *decode_args,  # the command bench records
                    "--out", out.replace(".json", f"-decode-{count}.json")]
        cli(sys.argv[1:])
    setattr(slot_fill, constant, default)


def main(argv: list[str] | None = None) -> int:
    argv, args, decode_args = probe_arguments(argv, __doc__, "64,128,256,512", 256, "experts in the host banks")
    host = [torch.zeros((args.pool, 2 * INTER, HIDDEN), dtype=torch.bfloat16).pin_memory(),
            torch.zeros((args.pool, HIDDEN, INTER), dtype=torch.bfloat16).pin_memory()]
    slots = [torch.zeros((64,) + tuple(h.shape[1:]), dtype=torch.bfloat16, device="cuda") for h in host]
    expert_bytes = sum(h[0].nbytes for h in host)
    rows = []
    default = slot_fill.MAX_PROGRAMS_PER_COPY
    for count in (1, 2, 4):
        plan_slots = torch.full((TOP_K,), -1, dtype=torch.int32, device="cuda")
        plan_fids = torch.full((TOP_K,), -1, dtype=torch.int32, device="cuda")
        plan_slots[:count] = torch.arange(count, dtype=torch.int32)
        moved = [0]

        def dma(count=count, moved=moved):  # fresh experts each call, as for the kernel
            moved[0] = (moved[0] + count) % (args.pool - count)
            for i in range(count):
                for h, s in zip(host, slots, strict=True):
                    s[i].copy_(h[moved[0] + i], non_blocking=True)

        us = _time(dma)
        rows.append({"experts": count, "path": "dma copies", "us": us, "gb_per_s": count * expert_bytes / us / 1e3})
        kernel = _kernel_fill(count, plan_slots, plan_fids, host, slots, args.pool)
        for programs in (int(x) for x in args.programs.split(",")):
            slot_fill.MAX_PROGRAMS_PER_COPY = programs
            us = _time(kernel)
            rows.append({"experts": count, "path": f"kernel, {programs} programs a copy", "programs": programs,
                         "us": us, "gb_per_s": count * expert_bytes / us / 1e3})
        for r in rows[-1 - len(args.programs.split(",")):]:
            print(f"{r['experts']} experts  {r['path']:28s} {r['us']:8.1f} us  {r['gb_per_s']:5.1f} GB/s",
                  file=sys.stderr)
    slot_fill.MAX_PROGRAMS_PER_COPY = default
    result = {"command": "python -m benchmarks.slot_fill_probe " + shlex.join(argv),
              "gpu": torch.cuda.get_device_name(), "expert_bytes": expert_bytes,
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "default_programs": default,
              "results": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    if decode_args:
        del host, slots
        decode_at_each_count(decode_args, args.out, [int(x) for x in args.programs.split(",")],
                             "MAX_PROGRAMS_PER_COPY", "fills")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
