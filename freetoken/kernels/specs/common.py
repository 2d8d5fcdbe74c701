"""What several pairs share: dtype names, and a tolerance per dtype."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.kernels.registry import Tolerance


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


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
