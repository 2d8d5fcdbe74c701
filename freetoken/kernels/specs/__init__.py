"""The built-in kernel/twin pairs of the registry (kernels/registry.py), each next to its case
type, one module per part of the engine. Cases are small frozen dataclasses whose repr
reproduces a failure. torch, triton and hypothesis are imported inside the functions, so
registering stays cheap. Each module registers its pairs when first imported; `load_all_specs`
imports them all.
"""

from __future__ import annotations

from freetoken.kernels.registry import REGISTRY, KernelSpec


def load_all_specs() -> dict[str, KernelSpec]:
    """The registry, holding every built-in pair (importing a spec module registers its pairs)."""
    from freetoken.kernels.specs import (  # noqa: F401
        cpu_branch,
        dense,
        hierarchy,
        linear,
        linear_attention,
        mxfp4,
        plan,
        quant,
    )

    return REGISTRY
