"""Pairs of the linear-attention kernels (Qwen3-Next / Qwen3.5): the gated delta rule's recurrent
and chunked kernels against the token-by-token twin, and the causal conv + SiLU against its twin.
Each case runs over a pool with more rows than sequences and its slots out of order, so a kernel
that reads or writes another sequence's slot differs in the pool the pair compares whole; some
cases make rows read-only (a captured step's padding), whose slots must come out unchanged."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.kernels.registry import BIT_EXACT, KernelSpec, register_kernel
from freetoken.kernels.specs.common import PerDtype, per_dtype_compare, torch_dtype


def _pool_and_slots(gen, batch: int, row_shape: tuple, dtype, fresh: bool, read_only: int):
    """A pool of batch + 2 rows of random values, and `batch` distinct slots in random order; the
    sequences' rows are zeros when `fresh` (a new sequence). The last `read_only` rows (at most
    batch) are read-only, -(s + 1): they start from their slot and must leave it as it was."""
    import torch

    pool = torch.randn(batch + 2, *row_shape, generator=gen).to(dtype)
    slots = torch.randperm(batch + 2, generator=gen)[:batch]
    if fresh:
        pool[slots] = 0
    kept = batch - min(read_only, batch)
    slots[kept:] = -slots[kept:] - 1
    return pool, slots


@dataclass(frozen=True)
class GatedDeltaCase:
    batch: int
    tokens: int
    heads: int  # key heads (value heads: heads * group)
    key_dim: int
    value_dim: int
    dtype: str  # q, k, v, beta and the output; g and the state stay fp32, as the model keeps them
    decay: float  # g drawn from [-decay, 0]: none (0) to a state forgotten within a few tokens (5)
    fresh: bool  # the sequences' state rows start at zero
    seed: int
    read_only: int = 0  # rows that start from a slot and write nothing (a captured step's padding)
    group: int = 1  # value heads per key head: `heads` key heads serve heads * group value heads

    def inputs(self):
        import torch

        gen = torch.Generator().manual_seed(self.seed)
        dt = torch_dtype(self.dtype)
        B, T, HK, DK, DV = self.batch, self.tokens, self.heads, self.key_dim, self.value_dim
        HV = HK * self.group
        q = (torch.randn(B, T, HK, DK, generator=gen) * 3).to(dt)
        k = (torch.randn(B, T, HK, DK, generator=gen) * 3).to(dt)
        v = torch.randn(B, T, HV, DV, generator=gen).to(dt)
        g = -torch.rand(B, T, HV, generator=gen) * self.decay
        beta = torch.rand(B, T, HV, generator=gen).to(dt)
        pool, slots = _pool_and_slots(gen, B, (HV, DK, DV), torch.float32, self.fresh, self.read_only)
        return q, k, v, g, beta, pool, slots


def _gated_delta_strategy(max_tokens: int):
    from hypothesis import strategies as st

    # dims off the powers of two (20, 24) exercise the masks; tokens past one 64-token chunk and
    # not a multiple of it exercise the padding and the state carried between chunks
    return lambda: st.builds(GatedDeltaCase, st.integers(1, 3), st.integers(1, max_tokens), st.integers(1, 2),
                             st.sampled_from([16, 20, 32]), st.sampled_from([16, 24, 32]),
                             st.sampled_from(["bfloat16", "float32"]), st.sampled_from([0.0, 0.1, 1.0, 5.0]),
                             st.booleans(), st.integers(0, 2**31 - 1), st.integers(0, 2), st.sampled_from([1, 2]))


def _gated_delta_pair(rule_name: str):
    def kernel(case: GatedDeltaCase, device: str):
        from freetoken.kernels.triton import gated_delta

        q, k, v, g, beta, pool, slots = (t.to(device) for t in case.inputs())
        out = getattr(gated_delta, rule_name)(q, k, v, g, beta, pool, slots)
        return out.cpu(), pool.cpu()

    return kernel


def _gated_delta_twin(case: GatedDeltaCase):
    from freetoken.reference.gated_delta import gated_delta_rule

    q, k, v, g, beta, pool, slots = case.inputs()
    return gated_delta_rule(q, k, v, g, beta, pool, slots), pool


# Kernel and twin compute the same fp32 values in another order (the chunked form through a
# triangular inverse, the recurrent one with other reduction trees). q and k are unit vectors and
# beta < 1, so every term is bounded by the state's and the values' size, and the order moves an
# output by a small multiple of fp32's rounding of max|twin|, not of the output itself: the
# absolute term, 2^-16 of the maximum, leaves room for 64-long sums and the inverse's substitution,
# while a wrong mask, decay or slot moves outputs by a sizeable fraction of it. bf16 outputs: the
# kernel and the twin round fp32 values that close to bf16 each, at most one ulp apart (2^-7
# relative), plus that absolute term. The state is fp32 for both dtypes (the fp32 bound).
GATED_DELTA_TOLERANCE = PerDtype(rel=2**-7, abs=2**-15, fp32_rel=2**-16, fp32_abs=2**-16)

for _name, _tokens, _examples, _what in (
        ("gated_delta_recurrent", 12, 12, "the token-by-token kernel (decode; any T)"),
        ("gated_delta_chunked", 80, 8, "the chunked WY/UT kernels (prefill)")):
    register_kernel(KernelSpec(
        name=_name, strategy=_gated_delta_strategy(_tokens), kernel=_gated_delta_pair(_name), twin=_gated_delta_twin,
        guarantee=GATED_DELTA_TOLERANCE, compare=per_dtype_compare, max_examples=_examples,
        doc=f"kernels/triton/gated_delta.py, {_what}, vs reference gated_delta_rule: output and the whole state "
            "pool within fp32 sum-order error of the maximum (bf16 outputs: one ulp more)",
    ))


@dataclass(frozen=True)
class CausalConvCase:
    batch: int
    tokens: int
    channels: int
    width: int
    dtype: str
    fresh: bool
    seed: int
    read_only: int = 0  # as GatedDeltaCase's

    def inputs(self):
        import torch

        gen = torch.Generator().manual_seed(self.seed)
        dt = torch_dtype(self.dtype)
        x = torch.randn(self.batch, self.tokens, self.channels, generator=gen).to(dt)
        weight = (torch.randn(self.channels, self.width, generator=gen) / self.width**0.5).to(dt)
        pool, slots = _pool_and_slots(gen, self.batch, (self.channels, self.width - 1), dt, self.fresh,
                                      self.read_only)
        return x, weight, pool, slots


def _causal_conv_strategy():
    from hypothesis import strategies as st

    # 300 channels span two channel blocks; over 64 tokens, two token blocks (the state copy); fewer
    # tokens than the state holds (1, 2) mix old state and new inputs in the new state
    return st.builds(CausalConvCase, st.integers(1, 3), st.sampled_from([1, 1, 2, 5, 64, 80]),
                     st.sampled_from([8, 40, 300]), st.sampled_from([2, 3, 4]),
                     st.sampled_from(["bfloat16", "float32"]), st.booleans(), st.integers(0, 2**31 - 1),
                     st.integers(0, 2))


def _causal_conv_kernel(case: CausalConvCase, device: str):
    from freetoken.kernels.triton.causal_conv import causal_conv1d

    x, weight, pool, slots = (t.to(device) for t in case.inputs())
    return causal_conv1d(x, weight, pool, slots).cpu(), pool.cpu()


def _causal_conv_twin(case: CausalConvCase):
    from freetoken.reference.causal_conv import causal_conv1d

    x, weight, pool, slots = case.inputs()
    return causal_conv1d(x, weight, pool, slots), pool


def _causal_conv_compare(got, want, guarantee: PerDtype) -> str | None:
    """The pool bit-exact (it holds copies of inputs); the output under the per-dtype bound."""
    from freetoken.kernels.registry import compare_outputs

    return compare_outputs(got[1], want[1], BIT_EXACT, "pool") or per_dtype_compare(got[0], want[0], guarantee,
                                                                                     "out")


# The sum is in the twin's tap order, but the GPU may fuse a product into it and SiLU's exp differs
# in its last bits: in fp32 a few ulps of the W terms' size (2^-18 of the maximum, relative and
# absolute). In bf16 the sum's last-bit difference can move its rounding by one ulp (at most 2^-7
# |z|) at a tie, which moves SiLU by |z silu'(z)| 2^-7: at most twice |silu(z)| 2^-7 wherever
# |1 + z (1 - sigmoid(z))| <= 2 (every z above -3.2), hence 2^-6 of max|twin|; the final rounding
# adds one output ulp (2^-7 relative).
CAUSAL_CONV_TOLERANCE = PerDtype(rel=2**-7, abs=2**-6, fp32_rel=2**-18, fp32_abs=2**-18)

register_kernel(KernelSpec(
    name="causal_conv", strategy=_causal_conv_strategy, kernel=_causal_conv_kernel, twin=_causal_conv_twin,
    guarantee=CAUSAL_CONV_TOLERANCE, compare=_causal_conv_compare, max_examples=15,
    doc="kernels/triton/causal_conv.py vs reference causal_conv1d: the conv pool bit-exact, the output "
        "within a last-bit difference of the sum and SiLU, rounded",
))


@dataclass(frozen=True)
class DeltaGatesCase:
    tokens: int  # B*T rows
    heads: int
    dtype: str
    strided: bool  # b and a as views of one wider projection, as the engine passes them
    seed: int

    def inputs(self):
        import torch

        gen = torch.Generator().manual_seed(self.seed)
        dt = torch_dtype(self.dtype)
        HV = self.heads
        # a spread past softplus's threshold (20) and far below 0, where log(1 + e) needs care
        wide = (torch.randn(1, self.tokens, 2 * HV + 3, generator=gen) * 12).to(dt)
        b, a = (wide[..., :HV], wide[..., HV:2 * HV]) if self.strided else (
            wide[..., :HV].contiguous(), wide[..., HV:2 * HV].contiguous())
        return b, a, torch.randn(HV, generator=gen), (torch.randn(HV, generator=gen) * 2).to(dt)


def _delta_gates_strategy():
    from hypothesis import strategies as st

    return st.builds(DeltaGatesCase, st.integers(1, 9), st.sampled_from([1, 6, 32, 48]),
                     st.sampled_from(["bfloat16", "float32"]), st.booleans(), st.integers(0, 2**31 - 1))


def _delta_gates_kernel(case: DeltaGatesCase, device: str):
    from freetoken.kernels.triton.delta_gates import delta_gates

    return tuple(t.cpu() for t in delta_gates(*(t.to(device) for t in case.inputs())))


def _delta_gates_twin(case: DeltaGatesCase):
    from freetoken.reference.gated_delta import delta_gates

    return delta_gates(*case.inputs())


def _delta_gates_compare(got, want, guarantee: PerDtype) -> str | None:
    """g is fp32 whatever the dtype (fp32's bound), beta in the dtype (its bound)."""
    return per_dtype_compare(got[0], want[0], guarantee, "g") or per_dtype_compare(got[1], want[1], guarantee,
                                                                                   "beta")


# g: exp and log to their last bits and log1p's rewrite, a few fp32 ulps (2^-19 relative). beta:
# one ulp of its dtype after the same sigmoid.
register_kernel(KernelSpec(
    name="delta_gates", strategy=_delta_gates_strategy, kernel=_delta_gates_kernel, twin=_delta_gates_twin,
    guarantee=PerDtype(rel=2**-7, abs=1e-6, fp32_rel=2**-19, fp32_abs=1e-30), compare=_delta_gates_compare,
    max_examples=15,
    doc="kernels/triton/delta_gates.py vs reference delta_gates: g within fp32 ulps, beta within one ulp",
))
