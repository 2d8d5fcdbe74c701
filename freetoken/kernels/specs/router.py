"""The router's fused decode kernel (kernels/triton/decode_router.py) and its twin: the logits
as `linear_twin` computes them, within decode_linear's tolerance; the routing of the kernel's
own logits as `route_by_logits` routes them, under route's guarantee (its ids exact). Routing
the twin's logits instead would fail on near ties that one bf16 ulp of a logit reorders.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from freetoken.kernels.registry import KernelSpec, register_kernel
from freetoken.kernels.specs.common import per_dtype_compare, torch_dtype
from freetoken.kernels.specs.dense import RoutingGuarantee, _route_compare

LOGITS = {"rel": 2**-7, "abs": 2**-10, "fp32_rel": 2**-16, "fp32_abs": 2**-16}  # decode_linear's
ROUTING = {"rel": 2**-20, "abs": 2**-126}  # route's


@dataclass(frozen=True)
class RouterGuarantee(RoutingGuarantee):
    """decode_linear's tolerance on the logits, route's guarantee on the routing of them."""

    fp32_rel: float = LOGITS["fp32_rel"]
    fp32_abs: float = LOGITS["fp32_abs"]

    def __str__(self) -> str:
        return f"logits as decode_linear; the routing of them as route ({super().__str__()})"


@dataclass(frozen=True)
class RouterCase:
    """A decode step's router: a few token rows through an [E, H] router weight."""

    rows: int
    hidden: int
    experts: int
    top_k: int
    dtype: str
    renormalize: bool
    weights_fp32: bool
    scale: float  # the weight's magnitude: near-uniform probabilities (small) to peaked ones
    seed: int

    def inputs(self):
        import torch

        g = torch.Generator().manual_seed(self.seed)
        dt = torch_dtype(self.dtype)
        x = torch.randn(self.rows, self.hidden, generator=g).to(dt)
        w = (torch.randn(self.experts, self.hidden, generator=g) * self.scale / self.hidden**0.5).to(dt)
        return x, w


def _router_strategy():
    from hypothesis import strategies as st

    @st.composite
    def cases(draw: Callable) -> RouterCase:
        experts = draw(st.sampled_from([4, 60, 128, 256]))
        return RouterCase(
            draw(st.integers(1, 4)), draw(st.sampled_from([16, 200, 2048])), experts,
            draw(st.integers(1, min(8, experts))), draw(st.sampled_from(["bfloat16", "float32"])), draw(st.booleans()),
            draw(st.booleans()), draw(st.sampled_from([0.01, 1.0, 30.0])), draw(st.integers(0, 2**31 - 1)),
        )

    return cases()


def _router_kernel(case: RouterCase, device: str) -> tuple:
    from freetoken.kernels.triton.decode_router import decode_router

    x, w = (t.to(device) for t in case.inputs())
    return tuple(t.cpu() for t in decode_router(x, w, case.top_k, case.renormalize, case.weights_fp32))


def _router_twin(case: RouterCase) -> tuple:
    from freetoken.kernels.triton.decode_linear import linear_twin
    from freetoken.reference.moe import route_by_logits

    def route(logits):
        return route_by_logits(logits, case.top_k, case.renormalize, case.weights_fp32)

    return linear_twin(*case.inputs()), route


def _router_compare(got: tuple, want: tuple, guarantee: RouterGuarantee) -> str | None:
    from freetoken.kernels.specs.common import PerDtype

    (logits, weights, ids), (want_logits, route) = got, want
    logits_tolerance = PerDtype(LOGITS["rel"], LOGITS["abs"], guarantee.fp32_rel, guarantee.fp32_abs)
    if found := per_dtype_compare(logits, want_logits, logits_tolerance, "logits"):
        return found
    return _route_compare((weights, ids), route(logits), guarantee)


ROUTING_GUARANTEE = RoutingGuarantee(rel=ROUTING["rel"], abs=ROUTING["abs"])  # route's, registered in dense.py

register_kernel(KernelSpec(
    name="decode_router", strategy=_router_strategy, kernel=_router_kernel, twin=_router_twin,
    guarantee=RouterGuarantee(rel=ROUTING["rel"], abs=ROUTING["abs"]), compare=_router_compare, max_examples=15,
    doc="kernels/triton/decode_router.py: logits vs fp32 sums rounded once (decode_linear's tolerance), the "
        "routing of those logits vs route_by_logits (ids exact)",
))
