"""Subcommand runners that import their module only when the subcommand runs, so that
`python -m freetoken --help` answers at once and never imports torch."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable


def lazy(module: str, function: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), function)(args)

    return run
