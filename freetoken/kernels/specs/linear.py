"""The decode_linear pair: a decode step's small linear layers against fp32 products and sums
rounded once, compared with a bound that grows with the sum of each output's terms' magnitudes;
and the norm_linear pair, the RMSNorm before such a layer in its launch."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.kernels.registry import KernelSpec, register_kernel
from freetoken.kernels.specs import dense  # noqa: F401  (norm_linear's guarantee reuses its pairs')
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


def _term_scale(x, w, b):
    """[M, N] fp64: the sum of each output's terms' magnitudes, |x| @ |w|.T (+ |b|). Summing the
    same terms in another order moves an output by a multiple of this, whatever the output's own
    size: a sum that cancels to near zero keeps its terms' rounding errors."""
    x, w, b = (t.double().abs() if t is not None else None for t in (x, w, b))
    return x @ w.T + (b if b is not None else 0.0)


def _linear_kernel(case: LinearCase, device: str):
    from freetoken.kernels.triton.decode_linear import decode_linear

    x, w, b = (t.to(device) if t is not None else None for t in case.inputs())
    return decode_linear(x, w, b).cpu()


def _linear_twin(case: LinearCase):
    """The specification's output, with the term scale its comparison needs (the kernel's side
    returns the output alone)."""
    from freetoken.kernels.triton.decode_linear import linear_twin

    return linear_twin(*case.inputs()), _term_scale(*case.inputs())


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


@dataclass(frozen=True)
class NormLinearCase:
    """The residual stream's rows (plus the layer's delta, or not: the first layer), normed,
    through a weight; the normed rows stored or not (the router's are, the projection's not)."""

    rows: int
    hidden: int
    out_features: int
    add: bool
    bias: bool
    store_normed: bool
    dtype: str
    scale: float  # the residual stream's magnitude
    seed: int

    def inputs(self):
        import torch

        g = torch.Generator().manual_seed(self.seed)
        dt = torch_dtype(self.dtype)
        h = (torch.randn(self.rows, self.hidden, generator=g) * self.scale).to(dt)
        delta = (torch.randn(self.rows, self.hidden, generator=g) * self.scale).to(dt) if self.add else None
        norm_w = (1 + 0.1 * torch.randn(self.hidden, generator=g)).to(dt)
        w = (torch.randn(self.out_features, self.hidden, generator=g) / self.hidden**0.5).to(dt)
        b = torch.randn(self.out_features, generator=g).to(dt) if self.bias else None
        return h, delta, norm_w, w, b


def _norm_linear_strategy():
    from hypothesis import strategies as st

    return st.builds(NormLinearCase, st.integers(1, 4), st.sampled_from([16, 200, 1024, 2048]),
                     st.sampled_from([1, 3, 64, 129, 512]), st.booleans(), st.booleans(), st.booleans(),
                     st.sampled_from(["bfloat16", "float32"]), st.sampled_from([1e-2, 1.0, 300.0]),
                     st.integers(0, 2**31 - 1))


def _norm_linear_kernel(case: NormLinearCase, device: str) -> dict:
    """The launch as the case asks; where it keeps no normed rows, a second launch that keeps
    them supplies the rows its products are checked against (and must give the same products)."""
    import torch

    from freetoken.kernels.triton.norm_linear import _launch

    h, delta, norm_w, w, b = (t.to(device) if t is not None else None for t in case.inputs())
    total, normed, out = _launch(h, delta, norm_w, 1e-6, w, b, case.store_normed)
    if normed is None:
        _, normed, again = _launch(h, delta, norm_w, 1e-6, w, b, True)
        if not torch.equal(again, out):
            raise AssertionError("keeping the normed rows changed the products")
    return {"sum": total.cpu(), "normed": normed.cpu(), "out": out.cpu()}


def _norm_linear_twin(case: NormLinearCase) -> dict:
    """The twin's sum and normed rows; the products are compared against `linear_twin` applied to
    the kernel's own normed rows (`_norm_linear_compare`), so that a one-ulp norm difference is
    not counted again in every product."""
    from freetoken.kernels.triton.norm_linear import norm_linear_twin

    h, delta, norm_w, w, b = case.inputs()
    total, normed, _ = norm_linear_twin(h, delta, norm_w, 1e-6, w, b)
    return {"sum": total, "normed": normed, "case": case}


@dataclass(frozen=True)
class NormLinearGuarantee:
    norm: object  # the rms_norm pair's Tolerance
    linear: TermsTolerance  # the decode_linear pair's

    def __str__(self) -> str:
        return f"sum bit-exact; normed {self.norm}; products {self.linear}"


def _norm_linear_compare(got: dict, want: dict, guarantee: NormLinearGuarantee) -> str | None:
    from freetoken.kernels.registry import BIT_EXACT, compare_outputs
    from freetoken.kernels.triton.decode_linear import linear_twin

    if found := compare_outputs(got["sum"], want["sum"], BIT_EXACT, "sum"):
        return found
    if found := compare_outputs(got["normed"], want["normed"], guarantee.norm, "normed"):
        return found
    _, _, _, w, b = want["case"].inputs()
    normed = got["normed"]
    if found := _linear_compare(got["out"], (linear_twin(normed, w, b), _term_scale(normed, w, b)), guarantee.linear):
        return "products: " + found
    return None


def _norm_linear_guarantee() -> NormLinearGuarantee:
    from freetoken.kernels.registry import REGISTRY

    return NormLinearGuarantee(REGISTRY["rms_norm"].guarantee, REGISTRY["decode_linear"].guarantee)


register_kernel(KernelSpec(
    name="norm_linear", strategy=_norm_linear_strategy, kernel=_norm_linear_kernel, twin=_norm_linear_twin,
    guarantee=_norm_linear_guarantee(), compare=_norm_linear_compare, max_examples=15,
    doc="kernels/triton/norm_linear.py vs add_rms_norm (or rms_norm) then linear_twin: the sum bit-exact, the "
        "normed rows as the rms_norm pair, the products as the decode_linear pair against linear_twin applied to "
        "the kernel's own normed rows (the twin's where the kernel does not store them)",
))
