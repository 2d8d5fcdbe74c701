"""Command line: `python -m freetoken {serve,generate,synth} ...`.

Imports are lazy, so `--help` answers at once and never imports torch.
"""

from __future__ import annotations

import argparse
import sys

from freetoken.cli_lazy import lazy


def _cmd_serve(args: argparse.Namespace) -> int:
    from freetoken.cli_args import engine_config_from, server_config_from

    server = server_config_from(args)
    from freetoken.server.main import run_server  # after the flags are checked: it imports the engine

    return run_server(engine_config_from(args), server)


def _cmd_generate(args: argparse.Namespace) -> int:
    from freetoken.cli_args import engine_config_from
    from freetoken.cli_generate import run_generate

    return run_generate(engine_config_from(args), args)


def build_parser() -> argparse.ArgumentParser:
    from freetoken.cli_args import add_engine_arguments, add_server_arguments  # no torch: config and msgspec
    from freetoken.cli_generate import add_generate_arguments

    parser = argparse.ArgumentParser(prog="freetoken", description="Edge-native MoE LLM serving engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve OpenAI-compatible HTTP APIs")
    add_engine_arguments(serve)
    add_server_arguments(serve)
    serve.set_defaults(run=_cmd_serve)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    add_engine_arguments(gen)
    add_generate_arguments(gen)
    gen.set_defaults(run=_cmd_generate)

    synth = sub.add_parser("synth", help="write a random-weight checkpoint in a real family's layout")
    from freetoken.loader.synth_cli import add_synth_arguments

    add_synth_arguments(synth)
    synth.set_defaults(run=lazy("freetoken.loader.synth_cli", "run_synth"))

    from freetoken.sim.cli import add_sim_arguments, add_synth_trace_arguments

    sim = sub.add_parser("sim", help="replay a routing trace through the cache policies")
    add_sim_arguments(sim)
    sim.set_defaults(run=lazy("freetoken.sim.cli", "run_sim"))
    trace = sub.add_parser("sim-trace", help="write a synthetic routing trace (calibrated skew and reuse)")
    add_synth_trace_arguments(trace)
    trace.set_defaults(run=lazy("freetoken.sim.cli", "run_synth_trace"))

    from freetoken.bench.cli import add_bench_arguments
    from freetoken.kernels.check_cli import add_kernels_arguments

    add_bench_arguments(sub.add_parser("bench", help="measure bandwidths and decode speed"))
    kernels = sub.add_parser("kernels", help="validate registered kernels against their twins")
    add_kernels_arguments(kernels)
    kernels.set_defaults(run=lazy("freetoken.kernels.check_cli", "run_kernels_check"))

    from freetoken.ctl import add_ctl_arguments  # standard library only

    ctl = sub.add_parser("ctl", help="inspect and resize a running server's caches")
    add_ctl_arguments(ctl)
    ctl.set_defaults(run=lazy("freetoken.ctl", "run_ctl"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from freetoken.errors import FreetokenError

    try:
        return args.run(args)
    except FreetokenError as exc:
        print(f"freetoken: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
