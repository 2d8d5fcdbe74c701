"""Command line: `python -m freetoken {serve,generate,synth} ...`.

Imports are lazy, so `--help` answers at once and never imports torch.
"""

from __future__ import annotations

import argparse
import sys

from freetoken.cli_lazy import lazy


def _engine_arguments(p: argparse.ArgumentParser, default_model: str | None) -> None:
    """The product flags `serve` and `generate` share, then the diagnostics group. The expert
    hierarchy's own parameters (hybrid's ratio, fills and depth) keep their defaults here;
    `bench decode/prefill --moe-param key=value` sets them."""
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
    moe.add_argument("--cpu-threads", type=int, default=None, help="CPU expert workers (default: physical cores)")
    moe.add_argument("--bw-profile", default=None, help="bandwidth profile file written by `bench bw`")
    diag = p.add_argument_group("diagnostics")
    diag.add_argument("--eager", action="store_true",
                      help="launch decode kernels one by one instead of replaying CUDA graphs (CUDA only)")
    diag.add_argument("--no-pdl", action="store_true",
                      help="launch the engine's Triton kernels in plain stream order instead of letting each start "
                           "while the one before drains (programmatic dependent launch, compute capability 9+)")
    diag.add_argument("--dense-kernels", choices=["fused", "reference"], default="fused",
                      help="attention, norms and routing as fused Triton kernels (CUDA), or the reference "
                           "torch ops at exact shapes (for debugging; decode then runs eagerly)")
    diag.add_argument("--moe-gemm", choices=["auto", "torch", "triton"], default="auto",
                      help="the expert GEMM over cache slots; auto: triton on CUDA, torch on CPU")
    diag.add_argument("--trace", default=None, help="write a Perfetto-loadable JSON timeline here at exit")
    diag.add_argument("--record-routing", default=None, help="write routing decisions as JSON lines here")
    diag.add_argument("--routing-replay", default=None, help="replace the router's choices with this trace's")


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
        moe_gemm=args.moe_gemm,
        cpu_threads=args.cpu_threads,
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
