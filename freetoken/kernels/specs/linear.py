"""The decode_linear pair: a decode step's small linear layers against fp32 products and sums
rounded once, compared with a bound that grows with the sum of each output's terms' magnitudes."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.kernels.registry import KernelSpec, register_kernel
from freetoken.kernels.specs.common import PerDtype, torch_dtype


@dataclass(frozen=True)
class LinearCase:
    """A decode step's linear layer: a few rows through a weight of any shape, with or without a bias."""

    rows: int
    in_features: int
    out_features: int
    bias: bool
    dtype: str
    seed: int

    def inputs(self):
        import torch

        g = torch.Generator().manual_seed(self.seed)
        dt = torch_dtype(self.dtype)
        x = torch.randn(self.rows, self.in_features, generator=g).to(dt)
        w = (torch.randn(self.out_features, self.in_features, generator=g) / self.in_features**0.5).to(dt)
        b = torch.randn(self.out_features, generator=g).to(dt) if self.bias else None
        return x, w, b


def _linear_strategy():
    from hypothesis import strategies as st

    # in_features off the block sizes (200, 1000), one block at one row (up to 4096: the weight tile
    # loaded before the PDL wait) and beyond one block (2048, 4096 at more rows; 6144); out_features
    # below one block of rows (1, 3) and ragged (129)
    return st.builds(LinearCase, st.integers(1, 4), st.sampled_from([16, 200, 1000, 2048, 4096, 6144]),
                     st.sampled_from([1, 3, 64, 129, 512]), st.booleans(), st.sampled_from(["bfloat16", "float32"]),
                     st.integers(0, 2**31 - 1))


def _term_scale(case: LinearCase):
    """[M, N] fp64: the sum of each output's terms' magnitudes, |x| @ |w|.T (+ |b|). Summing the
    same terms in another order moves an output by a multiple of this, whatever the output's own
    size: a sum that cancels to near zero keeps its terms' rounding errors."""
    x, w, b = (t.double().abs() if t is not None else None for t in case.inputs())
    return x @ w.T + (b if b is not None else 0.0)


def _linear_kernel(case: LinearCase, device: str):
    from freetoken.kernels.triton.decode_linear import decode_linear

    x, w, b = (t.to(device) if t is not None else None for t in case.inputs())
    return decode_linear(x, w, b).cpu()


def _linear_twin(case: LinearCase):
    """The specification's output, with the term scale its comparison needs (the kernel's side
    returns the output alone)."""
    from freetoken.kernels.triton.decode_linear import linear_twin

    return linear_twin(*case.inputs()), _term_scale(case)


@dataclass(frozen=True)
class TermsTolerance(PerDtype):
    """PerDtype's bound plus `terms` times the sum of the output's terms' magnitudes."""

    terms: float = 0.0

    def __str__(self) -> str:
        return f"{PerDtype.__str__(self)}; both + {self.terms:.3g}*sum|terms|"


def _linear_compare(got, want, guarantee: TermsTolerance) -> str | None:
    """As the registry compares tensors (NaN where the twin has NaN, infinities equal), with the
    twin's term scale added to the bound."""
    out, (twin, scale) = got, want
    import torch

    if out.dtype != twin.dtype or out.shape != twin.shape:
        return f"out: kernel {out.dtype}{tuple(out.shape)}, twin {twin.dtype}{tuple(twin.shape)}"
    tol = guarantee.for_dtype(twin.dtype)
    g, w = out.double(), twin.double()
    top = w.nan_to_num(0.0, 0.0, 0.0).abs().max() if w.numel() else 0.0
    bound = tol.rel * w.abs() + tol.abs * top + guarantee.terms * scale
    bad = ~((g - w).abs() <= bound) & ~(g.isnan() & w.isnan()) & (g != w)
    bad |= g.isinf() & w.isinf() & (g != w)
    if not bool(bad.any()):
        return None
    idx = tuple(int(i) for i in torch.nonzero(bad)[0])
    return (f"out{list(idx)}: kernel {out[idx].item()!r}, twin {twin[idx].item()!r}, sum|terms| "
            f"{scale[idx].item():.3g} ({int(bad.sum())} elements differ)")


register_kernel(KernelSpec(
    name="decode_linear", strategy=_linear_strategy, kernel=_linear_kernel, twin=_linear_twin,
    guarantee=TermsTolerance(rel=2**-7, abs=2**-10, fp32_rel=2**-16, fp32_abs=2**-16, terms=2**-18),
    compare=_linear_compare, max_examples=15,
    doc="kernels/triton/decode_linear.py vs fp32 products and sums rounded once: one bf16 ulp (the fp32 sums "
        "differ in order only, which can move the rounding), plus a term for sums that cancel, scaled by the "
        "sum of the terms' magnitudes (an output summed in another order moves by that much, however small it is)",
))
