"""`python -m freetoken synth`: the command line over loader/synth.py."""

from __future__ import annotations

import argparse
import sys

from freetoken.config import SUPPORTED_ARCHS
from freetoken.loader.presets import PRESET_NAMES
from freetoken.loader.synth import DEFAULT_MAX_SHARD_BYTES, DTYPES, write_synthetic_checkpoint

# gguf_writer.FILE_TYPES' names, spelled here so that building the CLI imports no numpy
GGUF_FILE_TYPES = ("Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K", "BF16", "F32", "MXFP4")


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parse_size(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    raw = text.strip().upper()
    num = raw.rstrip("KMGIB")
    unit = raw[len(num) :]
    try:
        value = float(num) * units[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected a size such as 2GB or 500MB, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return int(value)


def add_synth_arguments(parser: argparse.ArgumentParser) -> None:
    # arch and preset are checked in run_synth, so a typo gets a message that lists the choices.
    parser.add_argument("--arch", required=True, help=f"one of: {', '.join(SUPPORTED_ARCHS)}")
    parser.add_argument("--preset", default="tiny", help=f"one of: {', '.join(PRESET_NAMES)} (default tiny)")
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers")
    parser.add_argument("--experts", type=int, default=None, help="override the number of experts")
    parser.add_argument("--top-k", dest="top_k", type=int, default=None, help="override experts per token")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--norm-topk-prob",
        dest="norm_topk_prob",
        type=_parse_bool,
        default=None,
        metavar="{true,false}",
        help="override renormalisation of the top-k router weights (not for mixtral)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weight dtype (default bfloat16)")
    parser.add_argument(
        "--max-shard-size",
        dest="max_shard_bytes",
        type=_parse_size,
        default=None,
        help="largest safetensors file before sharding, e.g. 2GB (default 2GiB)",
    )
    parser.add_argument(
        "--gguf",
        metavar="TYPE",
        default=None,
        help=f"write one GGUF file instead of a safetensors directory (qwen3_moe as qwen3moe, "
        f"qwen3_5_moe/qwen3_5_moe_text as qwen35moe, qwen3_next as qwen3next, gpt_oss as gpt-oss), of "
        f"type: {', '.join(GGUF_FILE_TYPES)}; K-quants need hidden and expert sizes that are "
        "multiples of 256 (preset tiny-gguf); gpt_oss takes MXFP4 only (its experts as synth --mxfp4 "
        "writes them, the rest BF16)",
    )
    parser.add_argument("--mxfp4", action="store_true",
                        help="gpt_oss: store the experts as MXFP4, as the released checkpoints do "
                        "(sizes multiples of 32)")
    parser.add_argument("--out", required=True, help="output directory (with --gguf: the .gguf file)")


def _write(args: argparse.Namespace) -> None:
    if args.mxfp4 and (args.arch != "gpt_oss" or args.gguf is not None):
        raise ValueError("--mxfp4 applies to gpt_oss safetensors checkpoints")
    if args.gguf is not None:
        from freetoken.loader.synth_gguf import write_synthetic_gguf

        # A GGUF is one file, and llama.cpp's MoE architectures always renormalise their top-k weights.
        if args.max_shard_bytes is not None:
            raise ValueError("--max-shard-size applies to safetensors output, not --gguf")
        if args.norm_topk_prob is not None:
            raise ValueError("--norm-topk-prob cannot be set with --gguf (llama.cpp always renormalises)")

        write_synthetic_gguf(
            args.out,
            args.arch,
            args.preset,
            file_type=args.gguf,
            layers=args.layers,
            experts=args.experts,
            top_k=args.top_k,
            seed=args.seed,
            dtype=args.dtype,
            quiet=False,
        )
        return
    if args.mxfp4:
        from freetoken.loader.synth_mxfp4 import write_mxfp4_checkpoint

        write = write_mxfp4_checkpoint
    else:
        write = write_synthetic_checkpoint
    write(
        args.out,
        args.arch,
        args.preset,
        layers=args.layers,
        experts=args.experts,
        top_k=args.top_k,
        seed=args.seed,
        dtype=args.dtype,
        norm_topk_prob=args.norm_topk_prob,
        max_shard_bytes=DEFAULT_MAX_SHARD_BYTES if args.max_shard_bytes is None else args.max_shard_bytes,
        quiet=False,
    )


def run_synth(args: argparse.Namespace) -> int:
    try:
        _write(args)
    except ValueError as exc:
        print(f"synth: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"synth: error writing {args.out}: {exc}", file=sys.stderr)
        return 1
    return 0


def synth_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="freetoken synth", description="Write a random-weight checkpoint.")
    add_synth_arguments(parser)
    return run_synth(parser.parse_args(argv))
