"""The built-in kernel/twin pairs of the registry (kernels/registry.py), each next to its case
type, one module per part of the engine. Cases are small frozen dataclasses whose repr
reproduces a failure. torch, triton and hypothesis are imported inside the functions, so
registering stays cheap. Importing this package registers every pair.
"""

from freetoken.kernels.specs import cpu_branch, dense, hierarchy, linear  # noqa: F401  (registers the pairs)
from freetoken.kernels.specs.dense import RouteCase
from freetoken.kernels.specs.hierarchy import PlanCase

__all__ = ["PlanCase", "RouteCase"]
