"""The dense decode path's pairs: RMSNorm (and add + norm), rotary, routing, decode attention (its
linear layers: specs/linear.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from freetoken.kernels.registry import BIT_EXACT, KernelSpec, Tolerance, register_kernel
from freetoken.kernels.specs.common import PerDtype, per_dtype_compare, torch_dtype

# The families' norms (reference/norms.py) -> (the fused kernel's name, the twin's name), plain
# norms and add + norm: "plain" rounds before the weight; "once" applies the weight first and
# rounds once (gpt_oss); "offset" stores the weight zero-centred and scales by 1 + w (Qwen3.5).
NORM_VARIANTS = {
    "plain": (("fused_rms_norm", "rms_norm"), ("fused_add_rms_norm", "add_rms_norm")),
    "once": (("fused_rms_norm_rounded_once", "rms_norm_rounded_once"),
             ("fused_add_rms_norm_rounded_once", "add_rms_norm_rounded_once")),
    "offset": (("fused_offset_rms_norm", "offset_rms_norm"), ("fused_offset_add_rms_norm", "offset_add_rms_norm")),
}


def _norm_weight(g, width: int, variant: str, dtype):
    """Weights near 1, or near 0 where they are stored zero-centred."""
    import torch

    return ((0 if variant == "offset" else 1) + 0.1 * torch.randn(width, generator=g)).to(dtype)


def _norm_pair(index: int):
    """(kernel, twin) calling the case's variant of the fused norm and its twin (index 0: norm, 1: add + norm)."""

    def kernel(case, device: str):
        from freetoken.kernels.triton import rms_norm as fused

        out = getattr(fused, NORM_VARIANTS[case.variant][index][0])(*(t.to(device) for t in case.inputs()), 1e-6)
        return out.float().cpu() if index == 0 else tuple(t.cpu() for t in out)

    def twin(case):
        from freetoken.reference import norms

        out = getattr(norms, NORM_VARIANTS[case.variant][index][1])(*case.inputs(), 1e-6)
        return out.float() if index == 0 else out

    return kernel, twin


@dataclass(frozen=True)
class NormCase:
    rows: int
    width: int
    dtype: str
    scale: float  # activations' magnitude (norms see both tiny and large residual streams)
    seed: int
    variant: str = "plain"  # a key of NORM_VARIANTS

    def inputs(self):
        import torch

        g = torch.Generator().manual_seed(self.seed)
        x = (torch.randn(self.rows, self.width, generator=g) * self.scale).to(torch_dtype(self.dtype))
        return x, _norm_weight(g, self.width, self.variant, torch_dtype(self.dtype))


def _norm_strategy():
    from hypothesis import strategies as st

    return st.builds(NormCase, st.integers(1, 9), st.sampled_from([16, 64, 128, 200, 1024, 2048]),
                     st.sampled_from(["bfloat16", "float32"]), st.sampled_from([1e-3, 1.0, 300.0]),
                     st.integers(0, 2**31 - 1), st.sampled_from(sorted(NORM_VARIANTS)))


_norm_kernel, _norm_twin = _norm_pair(0)

register_kernel(KernelSpec(
    name="rms_norm", strategy=_norm_strategy, kernel=_norm_kernel, twin=_norm_twin,
    guarantee=Tolerance(rel=2**-7, abs=1e-6), max_examples=20,
    doc="kernels/triton/rms_norm.py vs the reference rms_norm and its families' variants (rounded once, "
        "zero-centred weights): one bf16 ulp (sum order, rsqrt's last bit)",
))


@dataclass(frozen=True)
class GatedNormCase:
    rows: int
    width: int
    dtype: str
    seed: int

    def inputs(self):
        import torch

        g = torch.Generator().manual_seed(self.seed)
        dt = torch_dtype(self.dtype)
        x, gate = (torch.randn(2, self.rows, self.width, generator=g) * 3).to(dt)
        return x, gate, _norm_weight(g, self.width, "plain", dt)


def _gated_norm_strategy():
    from hypothesis import strategies as st

    return st.builds(GatedNormCase, st.integers(1, 9), st.sampled_from([16, 100, 128]),
                     st.sampled_from(["bfloat16", "float32"]), st.integers(0, 2**31 - 1))


def _gated_norm_kernel(case: GatedNormCase, device: str):
    from freetoken.kernels.triton.rms_norm import fused_gated_rms_norm

    return fused_gated_rms_norm(*(t.to(device) for t in case.inputs()), 1e-6).float().cpu()


def _gated_norm_twin(case: GatedNormCase):
    from freetoken.reference.norms import gated_rms_norm

    return gated_rms_norm(*case.inputs(), 1e-6).float()


# bf16: the normed row may round one ulp apart (as rms_norm's), and times silu(gate) rounds again:
# two ulps (2^-6 relative). fp32: the sum order and exp's last bits, a few ulps.
register_kernel(KernelSpec(
    name="gated_rms_norm", strategy=_gated_norm_strategy, kernel=_gated_norm_kernel, twin=_gated_norm_twin,
    guarantee=PerDtype(rel=2**-6, abs=1e-6, fp32_rel=2**-19, fp32_abs=2**-24), compare=per_dtype_compare,
    max_examples=15,
    doc="kernels/triton/rms_norm.py's gated variant vs reference gated_rms_norm (the Gated DeltaNet's output "
        "norm): two bf16 ulps, a few fp32 ones",
))


@dataclass(frozen=True)
class RotaryCase:
    batch: int
    tokens: int
    heads: int
    head_dim: int
    dtype: str
    seed: int

    def inputs(self):
        import torch

        from freetoken.reference.rotary import Rotary

        g = torch.Generator().manual_seed(self.seed)
        dt = torch_dtype(self.dtype)
        x = torch.randn(self.batch, self.tokens, self.heads, self.head_dim, generator=g).to(dt)
        positions = torch.randint(0, 40000, (self.batch, self.tokens), generator=g)
        cos, sin = Rotary(self.head_dim, 1e6, "cpu").cos_sin(positions, dt)
        return x, cos, sin


def _rotary_strategy():
    from hypothesis import strategies as st

    return st.builds(RotaryCase, st.integers(1, 3), st.integers(1, 5), st.integers(1, 8),
                     st.sampled_from([8, 64, 96, 128]), st.sampled_from(["bfloat16", "float32"]),
                     st.integers(0, 2**31 - 1))


def _rotary_kernel(case: RotaryCase, device: str):
    from freetoken.kernels.triton.rotary import fused_rotary

    return fused_rotary(*(t.to(device) for t in case.inputs())).cpu()


def _rotary_twin(case: RotaryCase):
    from freetoken.reference.rotary import Rotary

    return Rotary.apply(*case.inputs())


register_kernel(KernelSpec(
    name="rotary", strategy=_rotary_strategy, kernel=_rotary_kernel, twin=_rotary_twin, guarantee=BIT_EXACT,
    max_examples=15, doc="kernels/triton/rotary.py vs Rotary.apply (same three roundings)",
))


@dataclass(frozen=True)
class RouteCase:
    """Router logits [rows, experts]: continuous, or drawn from a few values (exact ties, +-0)."""

    rows: int
    experts: int
    top_k: int
    dtype: str
    renormalize: bool
    weights_fp32: bool
    scale: float  # logits' magnitude: near-uniform probabilities (0.01) to one-hot ones (30)
    levels: int  # 0: randn logits; else multiples of scale/levels in [-scale, scale], signs flipped at random
    masked: bool  # a quarter of the experts at -inf (so top-k can reach -inf ties)
    seed: int

    def inputs(self):
        import torch

        g = torch.Generator().manual_seed(self.seed)
        shape = (self.rows, self.experts)
        if self.levels:
            steps = torch.randint(-self.levels, self.levels + 1, shape, generator=g) * (self.scale / self.levels)
            x = steps * torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)  # -0.0 among the zeros
        else:
            x = torch.randn(shape, generator=g) * self.scale
        if self.masked:
            x[:, torch.randperm(self.experts, generator=g)[: self.experts // 4]] = float("-inf")
        return x.to(torch_dtype(self.dtype))  # [N, E]


def _route_strategy():
    from hypothesis import strategies as st

    @st.composite
    def cases(draw: Callable) -> RouteCase:
        experts = draw(st.sampled_from([4, 8, 60, 64, 128, 256]))
        return RouteCase(
            draw(st.integers(1, 9)), experts, draw(st.integers(1, min(8, experts))),
            draw(st.sampled_from(["bfloat16", "float32"])), draw(st.booleans()), draw(st.booleans()),
            draw(st.sampled_from([0.01, 1.0, 30.0])), draw(st.sampled_from([0, 0, 1, 3, 16])), draw(st.booleans()),
            draw(st.integers(0, 2**31 - 1)),
        )

    return cases()


@dataclass(frozen=True)
class RoutingGuarantee(Tolerance):
    """Expert ids bit-exact; fp32 weights within the tolerance; bf16 weights at most one ulp apart
    (the rounding of fp32 values within the tolerance of each other)."""

    def __str__(self) -> str:
        return f"ids exact; fp32 weights {super().__str__()}; bf16 weights 1 ulp"


def _bf16_steps(t):
    """bf16 values as integers in the same order, consecutive values one apart (+0 and -0 both 0)."""
    import torch

    bits = t.view(torch.int16).int()
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def _route_compare(got: tuple, want: tuple, guarantee: RoutingGuarantee) -> str | None:
    import torch

    from freetoken.kernels.registry import compare_outputs

    (got_w, got_ids), (want_w, want_ids) = got, want
    if found := compare_outputs(got_ids, want_ids, BIT_EXACT, "out[1]"):
        return found
    if want_w.dtype != torch.bfloat16 or got_w.dtype != want_w.dtype or got_w.shape != want_w.shape:
        return compare_outputs(got_w, want_w, Tolerance(guarantee.rel, guarantee.abs), "out[0]")
    far = (_bf16_steps(got_w) - _bf16_steps(want_w)).abs() > 1
    if not far.any():
        return None
    idx = tuple(int(i) for i in far.nonzero()[0])
    return (f"out[0]{list(idx)}: kernel {got_w[idx].item()!r}, twin {want_w[idx].item()!r}, more than one "
            f"bf16 ulp apart ({int(far.sum())} elements)")


def _route_kernel(case: RouteCase, device: str) -> tuple:
    from freetoken.kernels.triton.routing import fused_route

    weights, ids = fused_route(case.inputs().to(device), case.top_k, case.renormalize, case.weights_fp32)
    return weights.cpu(), ids.cpu()


def _route_twin(case: RouteCase) -> tuple:
    from freetoken.reference.moe import route_by_logits

    return route_by_logits(case.inputs(), case.top_k, case.renormalize, case.weights_fp32)


register_kernel(KernelSpec(
    name="route", strategy=_route_strategy, kernel=_route_kernel, twin=_route_twin,
    guarantee=RoutingGuarantee(rel=2**-20, abs=2**-126), compare=_route_compare, max_examples=20,
    doc="kernels/triton/routing.py vs reference route_by_logits: ids exact, weights differ by exp's last "
        "bits and sum order",
))


@dataclass(frozen=True)
class AddNormCase:
    rows: int
    width: int
    dtype: str
    seed: int
    variant: str = "plain"  # a key of NORM_VARIANTS

    def inputs(self):
        import torch

        g = torch.Generator().manual_seed(self.seed)
        dt = torch_dtype(self.dtype)
        x, residual = (torch.randn(self.rows, self.width, generator=g) * 4).to(dt), torch.randn(self.rows, self.width,
                                                                                               generator=g).to(dt)
        return x, residual, _norm_weight(g, self.width, self.variant, dt)


def _add_norm_strategy():
    from hypothesis import strategies as st

    return st.builds(AddNormCase, st.integers(1, 9), st.sampled_from([16, 64, 200, 2048]),
                     st.sampled_from(["bfloat16", "float32"]), st.integers(0, 2**31 - 1),
                     st.sampled_from(sorted(NORM_VARIANTS)))


_add_norm_kernel, _add_norm_twin = _norm_pair(1)


def _add_norm_compare(got, want, guarantee: PerDtype) -> str | None:
    from freetoken.kernels.registry import compare_outputs

    return compare_outputs(got[0], want[0], BIT_EXACT, "out[0]") or per_dtype_compare(got[1], want[1], guarantee,
                                                                                         "out[1]")


register_kernel(KernelSpec(
    name="add_rms_norm", strategy=_add_norm_strategy, kernel=_add_norm_kernel, twin=_add_norm_twin,
    guarantee=PerDtype(rel=2**-7, abs=1e-6, fp32_rel=2**-20, fp32_abs=2**-24), compare=_add_norm_compare,
    max_examples=20,
    doc="kernels/triton/rms_norm.py's residual add + norm vs add_rms_norm and its families' variants: the sum "
        "bit-exact (rounded once, as the tensor add rounds it), the norm within one ulp of the dtype (sum order, "
        "rsqrt's last bit)",
))


@dataclass(frozen=True)
class DecodeAttentionCase:
    """One new token per sequence over keys scattered through a pool (pages in any order)."""

    batch: int
    kv_heads: int
    group: int  # query heads per key/value head
    head_dim: int
    key_len: int  # the step's key bucket
    splits: int  # 0: the engine's choice
    norm: bool  # Qwen3's per-head q/k norms
    dtype: str
    seed: int
    offset_norm: bool = False  # the norm weights zero-centred (Qwen3.5/Next)
    rotary_fraction: float = 1.0  # of each head's dims the rotary turns (Qwen3.5: 0.25)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_fraction)

    def inputs(self):
        import torch

        from freetoken.reference.rotary import Rotary

        g = torch.Generator().manual_seed(self.seed)
        dt = torch_dtype(self.dtype)
        B, hkv, hq, D = self.batch, self.kv_heads, self.kv_heads * self.group, self.head_dim
        pool = self.key_len * B + 8
        k_pool = torch.randn(pool, hkv, D, generator=g).to(dt)
        v_pool = torch.randn(pool, hkv, D, generator=g).to(dt)
        perm = torch.randperm(pool, generator=g)
        read_index = perm[: B * self.key_len].view(B, self.key_len)
        positions = torch.randint(0, self.key_len, (B,), generator=g)
        write_index = read_index[torch.arange(B), positions]  # the new token's key is among those read
        qkv = torch.randn(B, (hq + 2 * hkv) * D, generator=g).to(dt) * 3
        centre = 0.0 if self.offset_norm else 1.0
        norms = [(centre + 0.1 * torch.randn(D, generator=g)).to(dt) for _ in range(2)] if self.norm else [None, None]
        cos, sin = Rotary(self.rotary_dim, 1e6, "cpu").cos_sin(positions, dt)
        return qkv, hq, hkv, *norms, 1e-6, cos, sin, write_index, k_pool, v_pool, read_index, positions


def _attention_strategy():
    from hypothesis import strategies as st

    # Head dims up to 256 (the BLOCK_N = 32 branch), groups that are not powers of two (Qwen2-57B: 7),
    # zero-centred norms and partial rotaries (Qwen3.5's gated attention: 256 dims, a quarter turned).
    return st.builds(DecodeAttentionCase, st.integers(1, 3), st.integers(1, 2), st.sampled_from([1, 2, 3, 4, 7, 8]),
                     st.sampled_from([16, 64, 128, 256]), st.integers(1, 300), st.sampled_from([0, 0, 1, 3]),
                     st.booleans(), st.sampled_from(["bfloat16", "float32"]), st.integers(0, 2**31 - 1),
                     st.booleans(), st.sampled_from([1.0, 1.0, 0.5, 0.25]))


def _attention_run(case: DecodeAttentionCase, device: str, prep, attend, **kw) -> tuple:
    qkv, hq, hkv, qn, kn, eps, cos, sin, write_index, k_pool, v_pool, read_index, positions = (
        t.to(device) if hasattr(t, "to") else t for t in case.inputs())
    q = prep(qkv, hq, hkv, qn, kn, eps, cos, sin, write_index, k_pool, v_pool, rotary_dim=case.rotary_dim,
             offset_norm=case.offset_norm)
    out = attend(q, k_pool, v_pool, read_index, positions, **kw)
    return q.cpu(), k_pool.cpu(), v_pool.cpu(), out.cpu()


def _attention_kernel(case: DecodeAttentionCase, device: str) -> tuple:
    from freetoken.kernels.triton.decode_attention import decode_attention, qkv_prep

    return _attention_run(case, device, qkv_prep, decode_attention, splits=case.splits or None)


def _attention_twin(case: DecodeAttentionCase) -> tuple:
    from freetoken.kernels.triton.decode_attention import decode_attention_reference, qkv_prep_reference

    return _attention_run(case, "cpu", qkv_prep_reference, decode_attention_reference)


def _attention_compare(got, want, guarantee: PerDtype) -> str | None:
    """q, k and the pools as `per_dtype_compare`; the output's absolute term scales with the
    values, not with the output. Rounding a probability p to bf16 moves it by half an ulp, at
    most 2^-8 p (the kernel's fp32 p before rounding differs from the twin's in its last bits
    only), so sum_j p_j v_j moves by at most 2^-8 sum_j p_j |v_j| <= 2^-8 max|v|: twice the
    guarantee's absolute term (fp32: 2^-24 p, far inside it). An average of values can be far
    smaller than they are, so the bound held against max|out| did not hold (an H200 draw found
    it; tests/property/test_kernels.py keeps that case). max|v| is over the whole pool, other
    rows' keys included: per row, sum_j p_j |v_j| from the twin would be tighter, but the
    compare sees outputs only."""
    from freetoken.kernels.registry import Tolerance, compare_outputs

    found = per_dtype_compare(list(got[:3]), list(want[:3]), guarantee)
    if found:
        return found
    out, values = want[3], want[2]
    tol = guarantee.for_dtype(out.dtype)
    peak_out, peak_v = out.float().abs().max().item(), values.float().abs().max().item()
    scaled = Tolerance(tol.rel, 2 * tol.abs * peak_v / peak_out if peak_out > 0 else 0.0)
    return compare_outputs(got[3], out, scaled, "out[3]")


register_kernel(KernelSpec(
    name="decode_attention", strategy=_attention_strategy, kernel=_attention_kernel, twin=_attention_twin,
    guarantee=PerDtype(rel=2**-7, abs=2**-9, fp32_rel=2**-16, fp32_abs=2**-18), compare=_attention_compare,
    max_examples=15,
    doc="kernels/triton/decode_attention.py (q/k norm + rotary + pool write, then split-K paged attention) vs "
        "the reference ops and fp32 masked attention: q/k within the norm's bf16 ulp, v exact, output within "
        "the probabilities' rounding (for the output, twice the absolute term times max|v| instead of max|out|)",
))
