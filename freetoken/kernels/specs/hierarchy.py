"""The expert hierarchy's pairs: the plan's counters' tally, the slot GEMM, the slot fill and the bf16
rounding they share (the plan's own pair is in kernels/specs/plan.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from freetoken.kernels.registry import BIT_EXACT, KernelSpec, Tolerance, register_kernel
from freetoken.kernels.specs.common import routed_inputs, torch_dtype


@dataclass(frozen=True)
class GemmCase:
    """Shapes and a seed; `tensors()` draws x, weights, routes (-1 included) and the slot banks."""

    n: int
    k: int
    hidden: int
    inter: int
    slots: int
    x_dtype: str
    w_dtype: str
    scale: float
    small_blocks: bool  # tiles smaller than the problem, so that the kernels' loops and masks run
    seed: int
    landing: bool = False  # pass a fill list (every other route's slot): the act kernel's early path

    def landing_slots(self, routes):
        """A plan's copy_slots for the drawn routes: every other route's slot, then -1 padding."""
        flat = routes.flatten().clone()
        flat[1::2] = -1
        return flat if self.landing else None

    def tensors(self) -> tuple:
        import torch

        g = torch.Generator().manual_seed(self.seed)
        x, weights, routes = routed_inputs(g, self.n, self.k, self.slots, self.hidden, self.x_dtype, self.w_dtype,
                                           self.scale)
        w13 = torch.randn(self.slots, 2 * self.inter, self.hidden, generator=g) / self.hidden**0.5  # [S,2I,H]
        w2 = torch.randn(self.slots, self.hidden, self.inter, generator=g) / self.inter**0.5  # [S, H, I]
        return x, weights, routes, w13.to(torch_dtype(self.x_dtype)), w2.to(torch_dtype(self.x_dtype))


def _gemm_strategy():
    from hypothesis import strategies as st

    return st.builds(
        GemmCase, n=st.integers(1, 4), k=st.integers(1, 4), hidden=st.sampled_from([8, 24, 64, 96]),
        inter=st.sampled_from([8, 16, 40]), slots=st.integers(1, 6),
        x_dtype=st.sampled_from(["bfloat16", "float32"]), w_dtype=st.sampled_from(["float32", "bfloat16"]),
        scale=st.sampled_from([1.0, 30.0]), small_blocks=st.booleans(), seed=st.integers(0, 2**31 - 1),
        landing=st.booleans(),
    )


def _gemm_kernel(case: GemmCase, device: str):
    from freetoken.kernels.triton.moe_gemm import moe_slots_gemm

    blocks = {"act_blocks": (8, 16), "down_blocks": (8, 16)} if case.small_blocks else {}
    tensors = [t.to(device) for t in case.tensors()]
    landing = case.landing_slots(tensors[2])
    return moe_slots_gemm(*tensors, **blocks, landing=landing).cpu()


def _gemm_twin(case: GemmCase):
    from freetoken.reference.moe_slots import moe_slots

    return moe_slots(*case.tensors())


register_kernel(KernelSpec(
    name="moe_slots_gemm", strategy=_gemm_strategy, kernel=_gemm_kernel, twin=_gemm_twin,
    guarantee=Tolerance(rel=2.0**-7, abs=2.0**-16), max_examples=15,
    doc="kernels/triton/moe_gemm.py vs reference/moe_slots.py (fp32 math, summation order differs)",
))


@dataclass(frozen=True)
class FillCase:
    """Two banks (w13-like, w2-like) of `rows` experts, `slots` slots, and a copy plan with -1 holes."""

    rows: int
    slots: int
    row_shapes: tuple[tuple[int, ...], tuple[int, ...]]
    dtype: str  # the banks' dtype, or "bfloat16>float32": bf16 host rows widened into fp32 slots
    plan: tuple[tuple[int, int], ...]  # (slot, fid); (-1, -1) = an unused entry
    seed: int

    def banks(self) -> tuple[list, list]:
        import torch

        g = torch.Generator().manual_seed(self.seed)
        if self.dtype == "bfloat16>float32":
            host = [torch.randn((self.rows, *shape), generator=g).bfloat16() for shape in self.row_shapes]
            return host, [torch.randn((self.slots, *shape), generator=g) for shape in self.row_shapes]

        def bank(rows: int, shape: tuple[int, ...]):
            return torch.randint(0, 256, (rows, *shape, torch_dtype(self.dtype).itemsize), generator=g,
                                 dtype=torch.uint8).view(torch_dtype(self.dtype)).squeeze(-1)

        host = [bank(self.rows, shape) for shape in self.row_shapes]
        return host, [bank(self.slots, shape) for shape in self.row_shapes]


def _fill_strategy():
    from hypothesis import strategies as st

    @st.composite
    def cases(draw: Callable) -> FillCase:
        rows, slots = draw(st.integers(1, 12)), draw(st.integers(1, 8))
        # one to three banks of different row sizes: a launch fills two, a lone one goes alone
        shapes = tuple(draw(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 40)), min_size=1, max_size=3)))
        # a plan never names a slot twice
        used = draw(st.lists(st.integers(0, slots - 1), unique=True, max_size=slots))
        plan = [(s, draw(st.integers(0, rows - 1))) for s in used] + [(-1, -1)] * draw(st.integers(0, 3))
        plan = draw(st.permutations(plan)) if plan else [(-1, -1)]
        dtype = draw(st.sampled_from(["bfloat16", "float32", "uint8", "bfloat16>float32"]))
        return FillCase(rows, slots, shapes, dtype, tuple(plan), draw(st.integers(0, 2**31 - 1)))

    return cases()


def _fill_kernel(case: FillCase, device: str) -> list:
    import torch

    from freetoken.kernels.triton.slot_fill import fill_slots

    host, slots = case.banks()
    if device != "cpu":
        host = [h.pin_memory() for h in host]
    slots = [s.to(device) for s in slots]
    plan = torch.tensor(case.plan, dtype=torch.int32, device=device)  # [P, 2]
    fill_slots(plan[:, 0].contiguous(), plan[:, 1].contiguous(), host, slots)
    return [s.cpu() for s in slots]


def _fill_twin(case: FillCase) -> list:
    host, slots = case.banks()
    for slot, fid in case.plan:
        if slot >= 0:
            for h, s in zip(host, slots, strict=True):
                s[slot] = h[fid]
    return slots


register_kernel(KernelSpec(
    name="slot_fill", strategy=_fill_strategy, kernel=_fill_kernel, twin=_fill_twin, guarantee=BIT_EXACT,
    max_examples=15, doc="kernels/triton/slot_fill.py vs indexed assignment",
))


@dataclass(frozen=True)
class RoundCase:
    bits: tuple[int, ...]  # fp32 bit patterns

    def values(self):
        import torch

        return torch.tensor(self.bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _round_strategy():
    from hypothesis import strategies as st

    word = st.integers(0, 2**32 - 1)
    tie_heavy = st.builds(lambda hi, lo: hi << 16 | lo, st.integers(0, 2**16 - 1),
                          st.sampled_from([0, 0x7FFF, 0x8000, 0x8001, 0xFFFF]))
    return st.builds(RoundCase, st.lists(word | tie_heavy, min_size=1, max_size=300).map(tuple))


def _round_kernel(case: RoundCase, device: str):
    from freetoken.kernels.triton.rounding import round_to_bf16

    return round_to_bf16(case.values().to(device)).cpu()


register_kernel(KernelSpec(
    name="bf16_round", strategy=_round_strategy, kernel=_round_kernel,
    twin=lambda case: case.values().to(torch_dtype("bfloat16")), guarantee=BIT_EXACT, max_examples=20,
    doc="the rne_bf16 store helper vs torch's CPU cast (NaN payloads aside)",
))
