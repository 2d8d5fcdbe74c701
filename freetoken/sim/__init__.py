"""Routing-trace simulation: synthetic traces, and replay through the expert cache's policies.

- `synthetic`: `SyntheticConfig`, `generate`, `calibrated`, `trace_stats`, `write_trace`;
- `simulate`: `simulate` -> `SimResult`, `sweep` (JSON + PNG);
- `cli`: the `sim` and `sim-trace` command lines.

Names are imported on first use, so importing the package (or its CLI) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SyntheticConfig": "synthetic",
    "calibrated": "synthetic",
    "generate": "synthetic",
    "trace_stats": "synthetic",
    "write_trace": "synthetic",
    "SimResult": "simulate",
    "simulate": "simulate",
    "sweep": "simulate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
