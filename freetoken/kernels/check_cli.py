"""`python -m freetoken kernels check`: every built-in kernel/twin pair, or one, through Hypothesis."""

from __future__ import annotations

import argparse

from freetoken.kernels.registry import check_kernel
from freetoken.kernels.specs import load_all_specs


def add_kernels_arguments(parser: argparse.ArgumentParser) -> None:
    """`kernels check [NAME] [--device] [--examples] [--seed]`."""
    sub = parser.add_subparsers(dest="kernels_command", required=True)
    check = sub.add_parser("check", help="property-check Triton kernels against their twins")
    check.add_argument("name", nargs="?", choices=sorted(load_all_specs()), help="one kernel (default: all)")
    check.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                       help="cpu runs the kernels in Triton's interpreter")
    check.add_argument("--examples", type=int, default=None, help="cases per kernel (default: per kernel)")
    check.add_argument("--seed", type=int, default=None, help="fix Hypothesis's random choices")


def run_kernels_check(args: argparse.Namespace) -> int:
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    failed = 0
    for name in [args.name] if args.name else sorted(load_all_specs()):
        report = check_kernel(name, device, args.examples, args.seed)
        print(report.summary(), flush=True)
        failed += not report.passed
    return 1 if failed else 0
