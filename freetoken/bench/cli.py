"""`python -m freetoken bench {bw,decode}`: the measurements the engine's policies rely on."""

from __future__ import annotations

import argparse

from freetoken.cli_lazy import lazy


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True)
    from freetoken.bench.bw import add_bench_bw_arguments

    bw = sub.add_parser("bw", help="CPU/PCIe bandwidths, the CPU expert kernel and the slot fill; writes a profile")
    add_bench_bw_arguments(bw)
    bw.set_defaults(run=lazy("freetoken.bench.bw", "run_bench_bw"))

    from freetoken.bench.decode import add_bench_decode_arguments

    decode = sub.add_parser("decode", help="decode tok/s, hit rate and bytes moved per token, per policy")
    add_bench_decode_arguments(decode)
    decode.set_defaults(run=lazy("freetoken.bench.decode", "run_bench_decode"))

    from freetoken.bench.prefill import add_bench_prefill_arguments

    prefill = sub.add_parser("prefill", help="prefill tok/s for long prompts (layer streaming) against the floor")
    add_bench_prefill_arguments(prefill)
    prefill.set_defaults(run=lazy("freetoken.bench.prefill", "run_bench_prefill"))
