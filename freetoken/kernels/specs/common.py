"""What several pairs share: dtype names, a slot GEMM's routed inputs, and a tolerance per dtype."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.kernels.registry import Tolerance


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def routed_inputs(g, n: int, k: int, slots: int, hidden: int, x_dtype: str, w_dtype: str, scale: float = 1.0):
    """A slot GEMM's inputs drawn from generator g in this order: x [N, H] (randn * scale),
    weights [N, K] (uniform), routes [N, K] int32 in -1 .. slots-1 (-1: no expert)."""
    import torch

    x = (torch.randn(n, hidden, generator=g) * scale).to(torch_dtype(x_dtype))  # [N, H]
    weights = torch.rand(n, k, generator=g).to(torch_dtype(w_dtype))  # [N, K]
    routes = torch.randint(-1, slots, (n, k), generator=g, dtype=torch.int32)  # [N, K]
    return x, weights, routes


@dataclass(frozen=True)
class PerDtype(Tolerance):
    """`rel`/`abs` for bf16 tensors, `fp32_rel`/`fp32_abs` for fp32 ones (the outputs keep their
    dtype, so an fp32 error far above fp32's rounding is not hidden by bf16's tolerance)."""

    fp32_rel: float = 0.0
    fp32_abs: float = 0.0

    def for_dtype(self, dtype) -> Tolerance:
        import torch

        return Tolerance(self.rel, self.abs) if dtype == torch.bfloat16 else Tolerance(self.fp32_rel, self.fp32_abs)

    def __str__(self) -> str:
        return f"bf16 {Tolerance(self.rel, self.abs)}; fp32 {Tolerance(self.fp32_rel, self.fp32_abs)}"


def per_dtype_compare(got, want, guarantee: PerDtype, path: str = "out") -> str | None:
    from freetoken.kernels.registry import compare_outputs

    if isinstance(want, tuple | list):
        found = (per_dtype_compare(g, w, guarantee, f"{path}[{i}]") for i, (g, w) in enumerate(zip(got, want,
                                                                                                   strict=True)))
        return next((m for m in found if m), None)
    return compare_outputs(got, want, guarantee.for_dtype(want.dtype), path)
