"""Command line: `python -m freetoken {serve,generate,synth} ...`.

Imports are lazy, so `--help` answers at once and never imports torch.
"""

from __future__ import annotations

import argparse
import sys


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


def _engine_config(args: argparse.Namespace):
    from freetoken.config import EngineConfig

    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_running_requests=args.max_running_requests,
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    from freetoken.config import ServerConfig
    from freetoken.server.main import run_server

    return run_server(_engine_config(args), ServerConfig(host=args.host, port=args.port))


def _cmd_generate(args: argparse.Namespace) -> int:
    from freetoken.cli_generate import run_generate

    return run_generate(_engine_config(args), args)


def _cmd_synth(args: argparse.Namespace) -> int:
    from freetoken.loader.synth import run_synth

    return run_synth(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freetoken", description="Edge-native MoE LLM serving engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve OpenAI-compatible HTTP APIs")
    _engine_arguments(serve, default_model="demo")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
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
    from freetoken.loader.synth import add_synth_arguments

    add_synth_arguments(synth)
    synth.set_defaults(run=_cmd_synth)
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
