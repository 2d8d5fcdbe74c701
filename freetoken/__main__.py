"""Command line: `python -m freetoken {serve,generate,synth} ...`.

Imports are lazy, so `--help` answers at once and never imports torch.
"""

from __future__ import annotations

import argparse
import sys

from freetoken.cli_lazy import lazy


def _chunk_count(text: str) -> int:
    """argparse type: a count of chunks, at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes a count >= 1, got {value}")
    return value


def _engine_arguments(p: argparse.ArgumentParser, default_model: str | None) -> None:
    p.add_argument(
        "--model",
        default=default_model,
        required=default_model is None,
        help="a Hugging Face checkpoint directory, or 'demo' (a tiny synthetic model built on first use)",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--max-model-len", type=int, default=4096, help="prompt + output tokens per sequence")
    p.add_argument("--max-running-requests", type=int, default=4, help="sequences decoded together")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="KV cache size in tokens (default: --max-model-len for each running request)")
    p.add_argument("--prefill-chunk", type=int, default=8192,
                   help="prompt tokens per prefill step (each streams every offloaded expert layer once)")
    p.add_argument("--no-prefix-reuse", action="store_true", help="never share cached KV pages between requests")
    moe = p.add_argument_group("expert hierarchy")
    moe.add_argument("--moe-policy", default="auto",
                     choices=["auto", "resident", "transfer", "cpu", "static", "hybrid"],
                     help="how cache misses are served; auto: resident if every expert fits, else hybrid")
    size = moe.add_mutually_exclusive_group()
    size.add_argument("--moe-cache-slots", type=int, default=None, help="GPU expert slots (default: what fits)")
    size.add_argument("--moe-cache-rate", type=float, default=None, help="GPU expert slots as a fraction of the pool")
    moe.add_argument("--moe-ratio", type=float, default=None,
                     help="hybrid's PCIe share r in [0, 1] (default: from the `bench bw` profile)")
    moe.add_argument("--no-fetch-recurring", action="store_true",
                     help="hybrid: split every miss by q* alone, even one that recurs at every token")
    moe.add_argument("--no-background-fills", action="store_true",
                     help="hybrid: a layer waits for every expert it fetches, instead of running the ones beyond "
                          "q*'s share on the CPU while their slots fill for later steps")
    moe.add_argument("--split-misses", action="store_true",
                     help="hybrid: where q*'s whole-expert split leaves a layer's PCIe and CPU branches apart, split "
                          "one miss by its rows between them (off: on the H200 it was slower, BENCHMARKS.md)")
    moe.add_argument("--background-fill-engine", choices=["copy", "kernel"], default="copy",
                     help="graph decode: background fills as copy-engine transfers the CPU poller queues (copy), "
                          "or as a fill kernel reading the pinned pool on a side stream (kernel)")
    moe.add_argument("--copy-fill-depth", type=_chunk_count, default=None,
                     help="graph decode, copy-engine fills: 512 KiB chunks that may stream in at once (default: "
                          "the engine's, measured best on the H200; more: faster fills, slower CPU hand-offs)")
    moe.add_argument("--reroute-landing", action="store_true",
                     help="graph decode, copy-engine fills: a route to a slot whose fill has not landed yet runs on "
                          "the CPU instead of waiting for it (routes then depend on timing: tokens may differ from "
                          "eager decode's; on the H200 it gained nothing over waiting)")
    moe.add_argument("--moe-gemm", choices=["auto", "torch", "triton"], default="auto")
    moe.add_argument("--cpu-threads", type=int, default=None, help="CPU expert workers (default: physical cores)")
    moe.add_argument("--cpu-branch", choices=["worker", "inline"], default="worker",
                     help="CPU routes on the executor's worker (started first) or inline after queuing GPU work")
    moe.add_argument("--cpu-poller", choices=["team", "per-call"], default="team",
                     help="graph decode: the CPU threads stay assembled through a step (team) or start a "
                          "parallel region per MoE layer (per-call)")
    moe.add_argument("--cpu-handoff", choices=["fused", "stream-memops"], default="fused",
                     help="graph decode: the hand-off kernels ring the CPU and wait for its answer themselves "
                          "(fused), or stream memory operations do (stream-memops)")
    moe.add_argument("--bw-profile", default=None, help="bandwidth profile file written by `bench bw`")
    moe.add_argument("--eager", action="store_true",
                     help="launch decode kernels one by one instead of replaying CUDA graphs (CUDA only)")
    moe.add_argument("--no-pdl", action="store_true",
                     help="launch the engine's Triton kernels in plain stream order instead of letting each start "
                          "while the one before drains (programmatic dependent launch, compute capability 9+)")
    moe.add_argument("--dense-kernels", choices=["fused", "reference"], default="fused",
                     help="attention, norms and routing as fused Triton kernels (CUDA), or the reference "
                          "torch ops at exact shapes (for debugging; decode then runs eagerly)")
    obs = p.add_argument_group("observability")
    obs.add_argument("--trace", default=None, help="write a Perfetto-loadable JSON timeline here at exit")
    obs.add_argument("--record-routing", default=None, help="write routing decisions as JSON lines here")
    obs.add_argument("--routing-replay", default=None, help="replace the router's choices with this trace's")


def _engine_config(args: argparse.Namespace):
    from freetoken.config import EngineConfig

    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_running_requests=args.max_running_requests,
        kv_tokens=args.kv_tokens,
        prefill_chunk=args.prefill_chunk,
        prefix_reuse=not args.no_prefix_reuse,
        moe_policy=args.moe_policy,
        moe_cache_slots=args.moe_cache_slots,
        moe_cache_rate=args.moe_cache_rate,
        moe_ratio=args.moe_ratio,
        moe_fetch_recurring=not args.no_fetch_recurring,
        moe_background_fills=not args.no_background_fills,
        moe_background_fill_engine=args.background_fill_engine,
        moe_reroute_landing=args.reroute_landing,
        moe_split_misses=args.split_misses,
        **({} if args.copy_fill_depth is None else {"moe_copy_fill_depth": args.copy_fill_depth}),
        moe_gemm=args.moe_gemm,
        cpu_threads=args.cpu_threads,
        cpu_branch=args.cpu_branch,
        cpu_poller=args.cpu_poller,
        cpu_handoff=args.cpu_handoff,
        eager=args.eager,
        pdl=not args.no_pdl,
        dense_kernels=args.dense_kernels,
        bw_profile=args.bw_profile,
        trace=args.trace,
        record_routing=args.record_routing,
        routing_replay=args.routing_replay,
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    from freetoken.config import ServerConfig

    server = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=ServerConfig.secret(args.api_key, args.api_key_file, ServerConfig.API_KEY_ENV, "api-key"),
        admin_token=ServerConfig.secret(
            args.admin_token, args.admin_token_file, ServerConfig.ADMIN_TOKEN_ENV, "admin-token"
        ),
        allow_origins=tuple(args.allow_origin),
    )
    from freetoken.server.main import run_server  # after the flags are checked: it imports the engine

    return run_server(_engine_config(args), server)


def _cmd_generate(args: argparse.Namespace) -> int:
    from freetoken.cli_generate import run_generate

    return run_generate(_engine_config(args), args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freetoken", description="Edge-native MoE LLM serving engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve OpenAI-compatible HTTP APIs")
    _engine_arguments(serve, default_model="demo")
    serve.add_argument("--host", default="127.0.0.1",
                       help="the address to listen on (default: loopback only; 0.0.0.0 for every interface)")
    serve.add_argument("--port", type=int, default=8000)
    sec = serve.add_argument_group("security")
    sec.add_argument("--api-key", default=None,
                     help="required on every route but /health, as 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
                     "(default: $FREETOKEN_API_KEY; none: no key asked)")
    sec.add_argument("--api-key-file", default=None, help="read the API key from this file (kept out of `ps`)")
    sec.add_argument("--admin-token", default=None,
                     help="required (as a bearer token) by POST /v1/cache/resize, and accepted as the API key; "
                     "without it resizing is allowed on a loopback address only (default: $FREETOKEN_ADMIN_TOKEN)")
    sec.add_argument("--admin-token-file", default=None, help="read the admin token from this file")
    sec.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                     help="let web pages from ORIGIN (e.g. http://localhost:3000) call the APIs (CORS; repeatable; "
                     "default: none)")
    serve.set_defaults(run=_cmd_serve)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    _engine_arguments(gen, default_model="demo")
    gen.add_argument("--prompt", required=True, help="the prompt, tokenized as raw text unless --chat")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true",
                     help='print one JSON object {"prompt_token_ids", "token_ids", "text"} instead of streaming')
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
