"""The built-in kernel/twin pairs of the registry (kernels/registry.py), each next to its case
type. Cases are small frozen dataclasses whose repr reproduces a failure. torch, triton and
hypothesis are imported inside the functions, so registering stays cheap.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass

from freetoken.kernels.registry import BIT_EXACT, KernelSpec, Tolerance, register_kernel


@dataclass(frozen=True)
class PlanCase:
    """A cache of L*E experts and S slots, a starting state, and a sequence of plans."""

    num_layers: int
    num_experts: int
    num_slots: int
    placed: tuple[tuple[int, int], ...]  # (fid, slot) put in the cache before the first plan
    start_step: int  # the step counter before the first plan (last_* of placed fids lie below it)
    steps: tuple[tuple[int, tuple[tuple[int, ...], ...], str, int], ...]  # (layer, ids [N][K], policy, r)

    def initial_state(self):
        from freetoken.reference.expert_cache import CacheState

        state = CacheState(self.num_layers, self.num_experts, self.num_slots)
        for i, (fid, slot) in enumerate(self.placed):
            state.place(fid, slot)
            state.last_used[slot] = state.last_active[fid] = (i * 7919) % (self.start_step + 1)
        state.step = self.start_step
        return state


def _plan_strategy():
    from hypothesis import strategies as st

    from freetoken.reference.expert_cache import POLICIES

    @st.composite
    def cases(draw: Callable) -> PlanCase:
        L, E = draw(st.integers(1, 4)), draw(st.integers(2, 16))
        S = draw(st.integers(E, L * E))
        K = draw(st.integers(1, min(8, E)))
        max_n = draw(st.integers(1, 8))
        policies = draw(st.lists(st.sampled_from(POLICIES), min_size=1, max_size=3, unique=True))
        special = [0, 1, 21845, 32768, 65535, 65536]  # ends, thirds and halves (q* cost ties)
        ratio = draw(st.sampled_from(special) | st.integers(0, 65536))
        jitter = draw(st.booleans())  # a fresh ratio every plan (bandwidths refreshed live)
        hot, p_hot = draw(st.integers(1, E)), draw(st.sampled_from([0.0, 0.5, 0.9]))
        distinct = draw(st.booleans())  # top-k rows hold distinct experts; the plan must not care
        rng = random.Random(draw(st.integers(0, 2**32 - 1)))
        placed: tuple[tuple[int, int], ...] = ()
        if draw(st.booleans()):
            fids = rng.sample(range(L * E), rng.randint(0, S))
            placed = tuple(zip(fids, rng.sample(range(S), len(fids)), strict=True))
        hot_set = [rng.sample(range(E), hot) for _ in range(L)]
        steps = []
        for _ in range(draw(st.integers(64, 72))):
            layer = rng.randrange(L)
            rows = []
            for _ in range(rng.randint(1, max_n)):
                pool = hot_set[layer] if rng.random() < p_hot and hot >= K else range(E)
                rows.append(tuple(rng.sample(pool, K) if distinct else rng.choices(pool, k=K)))
            r = rng.choice([rng.randint(0, 65536), rng.choice(special)]) if jitter else ratio
            steps.append((layer, tuple(rows), rng.choice(policies), r))
        return PlanCase(L, E, S, placed, draw(st.sampled_from([0, 5, 1000])), tuple(steps))

    return cases()


def _plan_record(routes: list, copy_slots: list[int], copy_fids: list[int], counts: list[int], state) -> dict:
    return {"routes": routes, "copy_slots": copy_slots, "copy_fids": copy_fids, "counts": counts,
            "state": asdict(state)}


def _plan_kernel(case: PlanCase, device: str) -> list[dict]:
    import torch

    from freetoken.cache.device_state import DeviceCacheState
    from freetoken.kernels.triton.plan import POLICY_FETCH_MODE, plan_layer_device

    state = DeviceCacheState.from_reference(case.initial_state(), device)
    out = []
    for layer, ids, policy, ratio in case.steps:
        ids_t = torch.tensor(ids, device=device)  # [N, K]
        plan = plan_layer_device(state, layer, ids_t, POLICY_FETCH_MODE[policy], ratio)
        out.append(_plan_record(plan.routes.tolist(), plan.copy_slots.tolist(), plan.copy_fids.tolist(),
                                plan.counts.tolist(), state.to_reference()))
    return out


def _plan_twin(case: PlanCase) -> list[dict]:
    from freetoken.reference.expert_cache import plan_layer

    state = case.initial_state()
    out = []
    for layer, ids, policy, ratio in case.steps:
        plan = plan_layer(state, layer, [list(row) for row in ids], policy, ratio)
        pad = [-1] * (len(ids) * len(ids[0]) - len(plan.copies))  # the kernel's plan has a fixed width
        slots, fids = [s for s, _ in plan.copies] + pad, [f for _, f in plan.copies] + pad
        out.append(_plan_record(plan.routes, slots, fids, [plan.hits, plan.misses, plan.fetched], state))
    return out


register_kernel(KernelSpec(
    name="plan", strategy=_plan_strategy, kernel=_plan_kernel, twin=_plan_twin, guarantee=BIT_EXACT,
    max_examples=12, doc="kernels/triton/plan.py vs reference/expert_cache.py: outputs and state, every step",
))


def _dtype(name: str):
    import torch

    return getattr(torch, name)


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

    def tensors(self) -> tuple:
        import torch

        g = torch.Generator().manual_seed(self.seed)
        x = (torch.randn(self.n, self.hidden, generator=g) * self.scale).to(_dtype(self.x_dtype))  # [N, H]
        weights = torch.rand(self.n, self.k, generator=g).to(_dtype(self.w_dtype))  # [N, K]
        routes = torch.randint(-1, self.slots, (self.n, self.k), generator=g, dtype=torch.int32)  # [N, K]
        w13 = torch.randn(self.slots, 2 * self.inter, self.hidden, generator=g) / self.hidden**0.5  # [S,2I,H]
        w2 = torch.randn(self.slots, self.hidden, self.inter, generator=g) / self.inter**0.5  # [S, H, I]
        return x, weights, routes, w13.to(_dtype(self.x_dtype)), w2.to(_dtype(self.x_dtype))


def _gemm_strategy():
    from hypothesis import strategies as st

    return st.builds(
        GemmCase, n=st.integers(1, 4), k=st.integers(1, 4), hidden=st.sampled_from([8, 24, 64, 96]),
        inter=st.sampled_from([8, 16, 40]), slots=st.integers(1, 6),
        x_dtype=st.sampled_from(["bfloat16", "float32"]), w_dtype=st.sampled_from(["float32", "bfloat16"]),
        scale=st.sampled_from([1.0, 30.0]), small_blocks=st.booleans(), seed=st.integers(0, 2**31 - 1),
    )


def _gemm_kernel(case: GemmCase, device: str):
    from freetoken.kernels.triton.moe_gemm import moe_slots_gemm

    blocks = {"act_blocks": (8, 16), "down_blocks": (8, 16)} if case.small_blocks else {}
    return moe_slots_gemm(*(t.to(device) for t in case.tensors()), **blocks).cpu()


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
    dtype: str
    plan: tuple[tuple[int, int], ...]  # (slot, fid); (-1, -1) = an unused entry
    seed: int

    def banks(self) -> tuple[list, list]:
        import torch

        g = torch.Generator().manual_seed(self.seed)

        def bank(rows: int, shape: tuple[int, ...]):
            return torch.randint(0, 256, (rows, *shape, _dtype(self.dtype).itemsize), generator=g,
                                 dtype=torch.uint8).view(_dtype(self.dtype)).squeeze(-1)

        host = [bank(self.rows, shape) for shape in self.row_shapes]
        return host, [bank(self.slots, shape) for shape in self.row_shapes]


def _fill_strategy():
    from hypothesis import strategies as st

    @st.composite
    def cases(draw: Callable) -> FillCase:
        rows, slots = draw(st.integers(1, 12)), draw(st.integers(1, 8))
        shapes = draw(st.tuples(*[st.tuples(st.integers(1, 9), st.integers(1, 40))] * 2))
        # a plan never names a slot twice
        used = draw(st.lists(st.integers(0, slots - 1), unique=True, max_size=slots))
        plan = [(s, draw(st.integers(0, rows - 1))) for s in used] + [(-1, -1)] * draw(st.integers(0, 3))
        plan = draw(st.permutations(plan)) if plan else [(-1, -1)]
        return FillCase(rows, slots, shapes, draw(st.sampled_from(["bfloat16", "float32", "uint8"])),
                        tuple(plan), draw(st.integers(0, 2**31 - 1)))

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
    from freetoken.kernels.triton.moe_gemm import round_to_bf16

    return round_to_bf16(case.values().to(device)).cpu()


register_kernel(KernelSpec(
    name="bf16_round", strategy=_round_strategy, kernel=_round_kernel,
    twin=lambda case: case.values().to(_dtype("bfloat16")), guarantee=BIT_EXACT, max_examples=20,
    doc="the rne_bf16 store helper vs torch's CPU cast (NaN payloads aside)",
))


@dataclass(frozen=True)
class NormCase:
    rows: int
    width: int
    dtype: str
    scale: float  # activations' magnitude (norms see both tiny and large residual streams)
    seed: int

    def inputs(self):
        import torch

        g = torch.Generator().manual_seed(self.seed)
        x = (torch.randn(self.rows, self.width, generator=g) * self.scale).to(_dtype(self.dtype))
        w = (1 + 0.1 * torch.randn(self.width, generator=g)).to(_dtype(self.dtype))
        return x, w


def _norm_strategy():
    from hypothesis import strategies as st

    return st.builds(NormCase, st.integers(1, 9), st.sampled_from([16, 64, 128, 200, 1024, 2048]),
                     st.sampled_from(["bfloat16", "float32"]), st.sampled_from([1e-3, 1.0, 300.0]),
                     st.integers(0, 2**31 - 1))


def _norm_kernel(case: NormCase, device: str):
    from freetoken.kernels.triton.rms_norm import fused_rms_norm

    x, w = case.inputs()
    return fused_rms_norm(x.to(device), w.to(device), 1e-6).float().cpu()


def _norm_twin(case: NormCase):
    from freetoken.models.transformer import rms_norm

    x, w = case.inputs()
    return rms_norm(x, w, 1e-6).float()


register_kernel(KernelSpec(
    name="rms_norm", strategy=_norm_strategy, kernel=_norm_kernel, twin=_norm_twin,
    guarantee=Tolerance(rel=2**-7, abs=1e-6), max_examples=15,
    doc="kernels/triton/rms_norm.py vs the reference rms_norm: one bf16 ulp (sum order, rsqrt's last bit)",
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

        from freetoken.models.transformer import Rotary

        g = torch.Generator().manual_seed(self.seed)
        dt = _dtype(self.dtype)
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
    from freetoken.models.transformer import Rotary

    return Rotary.apply(*case.inputs())


register_kernel(KernelSpec(
    name="rotary", strategy=_rotary_strategy, kernel=_rotary_kernel, twin=_rotary_twin, guarantee=BIT_EXACT,
    max_examples=15, doc="kernels/triton/rotary.py vs Rotary.apply (same three roundings)",
))


@dataclass(frozen=True)
class HandoffCase:
    tokens: int
    rows: int  # mailbox rows (>= tokens)
    top_k: int
    hidden: int
    dtype: str
    base: int
    seed: int

    def inputs(self):
        import torch

        g = torch.Generator().manual_seed(self.seed)
        dt = _dtype(self.dtype)
        n, k, h = self.tokens, self.top_k, self.hidden
        x = (torch.randn(n, h, generator=g) * 3).to(dt)
        weights = torch.rand(n, k, generator=g).to(dt)
        ids = torch.randint(0, 64, (n, k), generator=g)
        routes = torch.where(torch.rand(n, k, generator=g) < 0.5, -1, torch.randint(0, 9, (n, k), generator=g))
        cpu_out = torch.randn(self.rows, h, generator=g) * 2  # what the CPU wrote, fp32
        y = torch.randn(n, h, generator=g).to(dt)
        return x, weights, ids, routes.to(torch.int32), cpu_out, y


def _handoff_strategy():
    from hypothesis import strategies as st

    @st.composite
    def cases(draw: Callable) -> HandoffCase:
        n = draw(st.integers(1, 6))
        hidden = draw(st.sampled_from([8, 100, 1024, 2048, 2500]))
        dtype = draw(st.sampled_from(["bfloat16", "float32"]))
        return HandoffCase(n, n + draw(st.integers(0, 3)), draw(st.integers(1, 8)), hidden, dtype,
                           draw(st.sampled_from([0, 128, 6000])), draw(st.integers(0, 2**31 - 1)))

    return cases()


def _handoff_run(case: HandoffCase, device: str, post, add) -> list:
    import torch

    x, weights, ids, routes, cpu_out, y = (t.to(device) for t in case.inputs())
    mx = torch.zeros(case.rows, case.hidden, device=device)
    mw = torch.zeros(case.rows, case.top_k, device=device)
    mf = torch.full((case.rows, case.top_k), -7, dtype=torch.int32, device=device)
    post(x, weights, ids, routes, case.base, mx, mw, mf)
    return [t.cpu() for t in (mx, mw, mf, add(y, cpu_out))]


def _handoff_kernel(case: HandoffCase, device: str) -> list:
    from freetoken.kernels.triton.cpu_handoff import add_cpu_result, post_cpu_work

    return _handoff_run(case, device, post_cpu_work, add_cpu_result)


def _handoff_twin(case: HandoffCase) -> list:
    from freetoken.kernels.triton.cpu_handoff import add_cpu_result_torch, post_cpu_work_torch

    return _handoff_run(case, "cpu", post_cpu_work_torch, add_cpu_result_torch)


register_kernel(KernelSpec(
    name="cpu_handoff", strategy=_handoff_strategy, kernel=_handoff_kernel, twin=_handoff_twin,
    guarantee=BIT_EXACT, max_examples=15,
    doc="kernels/triton/cpu_handoff.py vs the torch copies and add of the CPU branch's hand-off",
))


@dataclass(frozen=True)
class FlagCase:
    """A sequence on one flag word: ("write", v) stores v; ("wait", v) must pass at once,
    since (int32)(word - v) >= 0 there (a wait that blocks would hang the check)."""

    ops: tuple[tuple[str, int], ...]


def _flag_strategy():
    from hypothesis import strategies as st

    @st.composite
    def cases(draw: Callable) -> FlagCase:
        word, ops = 0, []
        for _ in range(draw(st.integers(1, 12))):
            if draw(st.booleans()):
                word = draw(st.integers(-(2**31), 2**31 - 1))
                ops.append(("write", word))
            else:  # a value the word is at or past, across int32 wrap-around too
                behind = draw(st.sampled_from([0, 1, 2**31 - 1]) | st.integers(0, 2**31 - 1))
                ops.append(("wait", (word - behind + 2**31) % 2**32 - 2**31))
        return FlagCase(tuple(ops))

    return cases()


def _flag_kernel(case: FlagCase, device: str):
    import torch

    from freetoken.kernels.stream_flags import _wait_flag, _write_flag

    word = torch.zeros(1, dtype=torch.int32, device=device)
    for op, value in case.ops:
        (_write_flag if op == "write" else _wait_flag)[(1,)](word, value, num_warps=1)
    return word.cpu()


def _flag_twin(case: FlagCase):
    import torch

    writes = [value for op, value in case.ops if op == "write"]
    return torch.tensor(writes[-1:] or [0], dtype=torch.int32)


register_kernel(KernelSpec(
    name="stream_flags", strategy=_flag_strategy, kernel=_flag_kernel, twin=_flag_twin, guarantee=BIT_EXACT,
    max_examples=15, doc="kernels/stream_flags.py's Triton fallback: the write stores, a satisfied wait passes",
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
        return x.to(_dtype(self.dtype))  # [N, E]


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


def _per_dtype_compare(got, want, guarantee: PerDtype, path: str = "out") -> str | None:
    from freetoken.kernels.registry import compare_outputs

    if isinstance(want, tuple | list):
        found = (_per_dtype_compare(g, w, guarantee, f"{path}[{i}]") for i, (g, w) in enumerate(zip(got, want,
                                                                                                   strict=True)))
        return next((m for m in found if m), None)
    return compare_outputs(got, want, guarantee.for_dtype(want.dtype), path)


@dataclass(frozen=True)
class AddNormCase:
    rows: int
    width: int
    dtype: str
    seed: int

    def inputs(self):
        import torch

        g = torch.Generator().manual_seed(self.seed)
        dt = _dtype(self.dtype)
        x, residual = (torch.randn(self.rows, self.width, generator=g) * 4).to(dt), torch.randn(self.rows, self.width,
                                                                                               generator=g).to(dt)
        return x, residual, (1 + 0.1 * torch.randn(self.width, generator=g)).to(dt)


def _add_norm_strategy():
    from hypothesis import strategies as st

    return st.builds(AddNormCase, st.integers(1, 9), st.sampled_from([16, 64, 200, 2048]),
                     st.sampled_from(["bfloat16", "float32"]), st.integers(0, 2**31 - 1))


def _add_norm_kernel(case: AddNormCase, device: str):
    from freetoken.kernels.triton.rms_norm import fused_add_rms_norm

    total, normed = fused_add_rms_norm(*(t.to(device) for t in case.inputs()), 1e-6)
    return total.cpu(), normed.cpu()


def _add_norm_twin(case: AddNormCase):
    from freetoken.models.transformer import add_rms_norm

    return add_rms_norm(*case.inputs(), 1e-6)


def _add_norm_compare(got, want, guarantee: PerDtype) -> str | None:
    from freetoken.kernels.registry import compare_outputs

    return compare_outputs(got[0], want[0], BIT_EXACT, "out[0]") or _per_dtype_compare(got[1], want[1], guarantee,
                                                                                         "out[1]")


register_kernel(KernelSpec(
    name="add_rms_norm", strategy=_add_norm_strategy, kernel=_add_norm_kernel, twin=_add_norm_twin,
    guarantee=PerDtype(rel=2**-7, abs=1e-6, fp32_rel=2**-20, fp32_abs=2**-24), compare=_add_norm_compare,
    max_examples=15,
    doc="kernels/triton/rms_norm.py's residual add + norm vs add_rms_norm: the sum bit-exact (rounded once, "
        "as the tensor add rounds it), the norm within one ulp of the dtype (sum order, rsqrt's last bit)",
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

    def inputs(self):
        import torch

        from freetoken.models.transformer import Rotary

        g = torch.Generator().manual_seed(self.seed)
        dt = _dtype(self.dtype)
        B, hkv, hq, D = self.batch, self.kv_heads, self.kv_heads * self.group, self.head_dim
        pool = self.key_len * B + 8
        k_pool = torch.randn(pool, hkv, D, generator=g).to(dt)
        v_pool = torch.randn(pool, hkv, D, generator=g).to(dt)
        perm = torch.randperm(pool, generator=g)
        read_index = perm[: B * self.key_len].view(B, self.key_len)
        positions = torch.randint(0, self.key_len, (B,), generator=g)
        write_index = read_index[torch.arange(B), positions]  # the new token's key is among those read
        qkv = torch.randn(B, (hq + 2 * hkv) * D, generator=g).to(dt) * 3
        norms = [(1 + 0.1 * torch.randn(D, generator=g)).to(dt) for _ in range(2)] if self.norm else [None, None]
        cos, sin = Rotary(D, 1e6, "cpu").cos_sin(positions, dt)
        return qkv, hq, hkv, *norms, 1e-6, cos, sin, write_index, k_pool, v_pool, read_index, positions


def _attention_strategy():
    from hypothesis import strategies as st

    # Head dims up to 256 (the BLOCK_N = 32 branch), groups that are not powers of two (Qwen2-57B: 7).
    return st.builds(DecodeAttentionCase, st.integers(1, 3), st.integers(1, 2), st.sampled_from([1, 2, 3, 4, 7, 8]),
                     st.sampled_from([16, 64, 128, 256]), st.integers(1, 300), st.sampled_from([0, 0, 1, 3]),
                     st.booleans(), st.sampled_from(["bfloat16", "float32"]), st.integers(0, 2**31 - 1))


def _attention_run(case: DecodeAttentionCase, device: str, prep, attend, **kw) -> tuple:
    qkv, hq, hkv, qn, kn, eps, cos, sin, write_index, k_pool, v_pool, read_index, positions = (
        t.to(device) if hasattr(t, "to") else t for t in case.inputs())
    q = prep(qkv, hq, hkv, qn, kn, eps, cos, sin, write_index, k_pool, v_pool)
    out = attend(q, k_pool, v_pool, read_index, positions, **kw)
    return q.cpu(), k_pool.cpu(), v_pool.cpu(), out.cpu()


def _attention_kernel(case: DecodeAttentionCase, device: str) -> tuple:
    from freetoken.kernels.triton.decode_attention import decode_attention, qkv_prep

    return _attention_run(case, device, qkv_prep, decode_attention, splits=case.splits or None)


def _attention_twin(case: DecodeAttentionCase) -> tuple:
    from freetoken.kernels.triton.decode_attention import decode_attention_reference, qkv_prep_reference

    return _attention_run(case, "cpu", qkv_prep_reference, decode_attention_reference)


register_kernel(KernelSpec(
    name="decode_attention", strategy=_attention_strategy, kernel=_attention_kernel, twin=_attention_twin,
    guarantee=PerDtype(rel=2**-7, abs=2**-9, fp32_rel=2**-16, fp32_abs=2**-18), compare=_per_dtype_compare,
    max_examples=15,
    doc="kernels/triton/decode_attention.py (q/k norm + rotary + pool write, then split-K paged attention) vs "
        "the reference ops and fp32 masked attention: q/k within the norm's bf16 ulp, v exact, output within "
        "bf16 probabilities' rounding",
))
