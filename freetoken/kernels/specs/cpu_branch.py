"""The graph-mode CPU branch's pairs: the mailbox hand-off, the stream flags, and pinned host buffers read
by kernels (a captured step's inputs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from freetoken.kernels.registry import BIT_EXACT, KernelSpec, register_kernel
from freetoken.kernels.specs.common import torch_dtype


@dataclass(frozen=True)
class HandoffCase:
    tokens: int
    rows: int  # mailbox rows (>= tokens)
    top_k: int
    hidden: int
    dtype: str
    base: int
    seed: int
    fills: bool = False  # hand over background fills (slot, fid) too
    # with fills: number them with fill tickets (kernels/cpu/copy_engine.py): (the last LANDED
    # seen, how far past it the latest slot's ticket is, the running count past that, how far
    # LANDED is past every slot's ticket: a wait that blocks would hang the check)
    tickets: tuple[int, int, int, int] | None = None
    ring: bool = False  # the fused mode: one program, a bell rung only where the layer has CPU work
    always: bool = False  # (ring) ring and write even without CPU work (a step's last layer)
    gpu_only: bool = False  # no route goes to the CPU

    def inputs(self):
        import torch

        from freetoken.kernels.triton.fill_tickets import wrap_int32

        g = torch.Generator().manual_seed(self.seed)
        dt = torch_dtype(self.dtype)
        n, k, h = self.tokens, self.top_k, self.hidden
        x = (torch.randn(n, h, generator=g) * 3).to(dt)
        weights = torch.rand(n, k, generator=g).to(dt)
        ids = torch.randint(0, 64, (n, k), generator=g)
        on_cpu = torch.rand(n, k, generator=g) < (0.0 if self.gpu_only else 0.5)
        routes = torch.where(on_cpu, -1, torch.randint(0, SLOTS, (n, k), generator=g))
        cpu_out = torch.randn(self.rows, h, generator=g) * 2  # what the CPU wrote, fp32
        y = torch.randn(n, h, generator=g).to(dt)
        # a plan's fill lists: some entries fetched (a fid), some of those in the background (a slot)
        fids = torch.where(torch.rand(n * k, generator=g) < 0.6, torch.randint(0, 5000, (n * k,), generator=g), -1)
        # (victims are distinct slots, as a plan's are: the kernel's scatter of tickets assumes it)
        victims = torch.randperm(SLOTS, generator=g)[: n * k]
        background = torch.where((fids >= 0) & (torch.rand(n * k, generator=g) < 0.5), victims, -1)
        copies = torch.where((fids >= 0) & (background < 0) & (torch.rand(n * k, generator=g) < 0.5), victims, -1)
        # per slot the ticket of its last fill, within 12 of the one furthest ahead
        seen, ahead, counted, past = self.tickets or (0, 0, 0, 0)
        words = torch.tensor([wrap_int32(seen + ahead - int(d)) for d in torch.randint(0, 12, (SLOTS,), generator=g)]
                             + [wrap_int32(seen + ahead + counted), seen], dtype=torch.int32)
        landed = torch.tensor([wrap_int32(seen + max(ahead, 0) + past)], dtype=torch.int32)
        return (x, weights, ids, routes.to(torch.int32), cpu_out, y, background.to(torch.int32), fids.to(torch.int32),
                copies.to(torch.int32), words, landed)


SLOTS = 700  # the slot cache the hand-off cases' slots index


def _handoff_strategy():
    from hypothesis import strategies as st

    @st.composite
    def cases(draw: Callable) -> HandoffCase:
        n = draw(st.integers(1, 6))
        hidden = draw(st.sampled_from([8, 100, 1024, 2048, 2500]))
        dtype = draw(st.sampled_from(["bfloat16", "float32"]))
        often = st.sampled_from([True, True, False])
        fills = draw(often)
        tickets = None
        ring = draw(st.booleans())
        if fills and draw(often):
            tickets = (draw(st.integers(-(2**31), 2**31 - 1)), draw(st.integers(-14, 5)), draw(st.integers(0, 9)),
                       draw(st.integers(0, 3)))
        return HandoffCase(n, n + draw(st.integers(0, 3)), draw(st.integers(1, 8)), hidden, dtype,
                           draw(st.sampled_from([0, 128, 6000])), draw(st.integers(0, 2**31 - 1)), fills, tickets,
                           ring, ring and draw(st.sampled_from([True, False, False, False])), draw(st.booleans()))

    return cases()


def _handoff_run(case: HandoffCase, device: str, post, add) -> list:
    import torch

    x, weights, ids, routes, cpu_out, y, background, fids, copies, words, landed = (t.to(device) for t in case.inputs())
    mx = torch.zeros(case.rows, case.hidden, device=device)
    mw = torch.zeros(case.rows, case.top_k, device=device)
    mf, ms, mc = (torch.full((case.rows, case.top_k), -7, dtype=torch.int32, device=device) for _ in range(3))
    tickets = (words, copies, landed) if case.tickets is not None else None
    bell = torch.zeros(1, dtype=torch.int32, device=device)
    post(x, weights, ids, routes, case.base, mx, mw, mf, bell=(bell, 7 + case.tokens) if case.ring else None,
         always=case.always, fills=(background, fids, ms, mc) if case.fills else None, tickets=tickets)
    return [t.cpu() for t in (mx, mw, mf, ms, mc, words, bell, add(y, cpu_out), routes)]


def _handoff_kernel(case: HandoffCase, device: str) -> list:
    from freetoken.kernels.triton.cpu_handoff import add_cpu_result, post_cpu_work

    return _handoff_run(case, device, post_cpu_work, add_cpu_result)


def _handoff_twin(case: HandoffCase) -> list:
    from freetoken.kernels.triton.cpu_handoff import add_cpu_result_torch, post_cpu_work_torch

    return _handoff_run(case, "cpu", post_cpu_work_torch, add_cpu_result_torch)


register_kernel(KernelSpec(
    name="cpu_handoff", strategy=_handoff_strategy, kernel=_handoff_kernel, twin=_handoff_twin,
    guarantee=BIT_EXACT, max_examples=80,
    doc="kernels/triton/cpu_handoff.py vs the torch copies and add of the CPU branch's hand-off (the fused "
        "ring's gating, the fill tickets' bookkeeping, routes to slots still landing sent to the CPU)",
))


@dataclass(frozen=True)
class FlagCase:
    """A sequence on one flag word: ("write", v) stores v; ("wait", v) must pass at once,
    since (int32)(word - v) >= 0 there (a wait that blocks would hang the check); ("skip", v):
    a gated wait whose gate is 0 passes at once whatever the word holds."""

    ops: tuple[tuple[str, int], ...]


def _flag_strategy():
    from hypothesis import strategies as st

    from freetoken.kernels.triton.fill_tickets import wrap_int32

    @st.composite
    def cases(draw: Callable) -> FlagCase:
        word, ops = 0, []
        for _ in range(draw(st.integers(1, 12))):
            if draw(st.booleans()):
                word = draw(st.integers(-(2**31), 2**31 - 1))
                ops.append(("write", word))
            elif draw(st.booleans()):  # a value the word is at or past, across int32 wrap-around too
                behind = draw(st.sampled_from([0, 1, 2**31 - 1]) | st.integers(0, 2**31 - 1))
                ops.append(("wait", wrap_int32(word - behind)))
            else:  # a value the word has not reached: only a gated-off wait may pass
                ahead = draw(st.integers(1, 2**31 - 1))
                ops.append(("skip", wrap_int32(word + ahead)))
        return FlagCase(tuple(ops))

    return cases()


def _flag_kernel(case: FlagCase, device: str):
    import torch

    from freetoken.kernels.stream_flags import _wait_flag, _write_flag
    from freetoken.kernels.triton.cpu_handoff import _wait_word_kernel

    word = torch.zeros(1, dtype=torch.int32, device=device)
    target = torch.zeros(1, dtype=torch.int32, device=device)
    gate = torch.zeros(1, dtype=torch.int32, device=device)
    fence = device == "cuda"
    for op, value in case.ops:
        target.fill_(value)
        if op == "write":
            _write_flag[(1,)](word, value, num_warps=1)
        elif op == "wait":  # every way of waiting: the atomic spin, the volatile one on a value in memory, gated on
            _wait_flag[(1,)](word, value, num_warps=1)
            _wait_word_kernel[(1,)](word, target, gate, GATED=False, FENCE=fence, num_warps=1)
            gate.fill_(1)
            _wait_word_kernel[(1,)](word, target, gate, GATED=True, FENCE=fence, num_warps=1)
        else:
            gate.fill_(0)
            _wait_word_kernel[(1,)](word, target, gate, GATED=True, FENCE=fence, num_warps=1)
    return word.cpu()


def _flag_twin(case: FlagCase):
    import torch

    writes = [value for op, value in case.ops if op == "write"]
    return torch.tensor(writes[-1:] or [0], dtype=torch.int32)


register_kernel(KernelSpec(
    name="stream_flags", strategy=_flag_strategy, kernel=_flag_kernel, twin=_flag_twin, guarantee=BIT_EXACT,
    max_examples=15, doc="kernels/stream_flags.py's Triton fallback and cpu_handoff.wait_word: the write stores, "
                         "a satisfied wait passes, a gated-off one too",
))


@dataclass(frozen=True)
class HostReadCase:
    """A small buffer moved `rounds` times between pinned host memory and the device, its source
    rewritten between moves: "read", a captured step's inputs, rewritten by the host before
    every replay; "write", what the host reads back after each step (counters, stamps)."""
    n: int
    dtype: str
    rounds: int
    seed: int
    direction: str = "read"

    def sources(self):
        import torch

        g = torch.Generator().manual_seed(self.seed)
        dt = torch_dtype(self.dtype)
        if dt.is_floating_point:
            return [torch.randn(self.n, generator=g).to(dt) for _ in range(self.rounds)]
        return [torch.randint(-(2**31), 2**31 - 1, (self.n,), generator=g).to(dt) for _ in range(self.rounds)]


def _host_read_strategy():
    import hypothesis.strategies as st

    return st.builds(HostReadCase, n=st.sampled_from([0, 1, 3, 130]) | st.integers(1, 5000),
                     dtype=st.sampled_from(["int64", "int32", "bfloat16"]), rounds=st.integers(1, 3),
                     seed=st.integers(0, 2**31 - 1), direction=st.sampled_from(["read", "write"]))


def _host_read_kernel(case: HostReadCase, device: str):
    import torch

    from freetoken.kernels.triton.host_read import read_host, write_host

    sources = case.sources()
    host = torch.full_like(sources[0], 7, pin_memory=device == "cuda")
    on_device = torch.full_like(sources[0], 7, device=device)
    seen = []
    for src in sources:  # the source is rewritten in place between moves
        if case.direction == "read":
            host.copy_(src)
            read_host(host, on_device)
            seen.append(on_device.cpu().clone())  # (.cpu() of a host tensor is the tensor itself)
        else:
            on_device.copy_(src)
            write_host(on_device, host)
            if device == "cuda":
                torch.cuda.synchronize()
            seen.append(host.clone())
    return seen


def _host_read_twin(case: HostReadCase):
    return case.sources()


register_kernel(KernelSpec(
    name="host_read", strategy=_host_read_strategy, kernel=_host_read_kernel, twin=_host_read_twin,
    guarantee=BIT_EXACT, max_examples=15,
    doc="kernels/triton/host_read.py: a buffer moved between pinned host memory and the device both ways, "
        "its source rewritten between moves",
))


@dataclass(frozen=True)
class HostEmbeddingCase:
    """Token ids [rows, cols] gathered from a [vocab, width] table in pinned host memory."""
    vocab: int
    width: int
    rows: int
    cols: int
    dtype: str
    seed: int

    def inputs(self):
        import torch

        g = torch.Generator().manual_seed(self.seed)
        table = torch.randn(self.vocab, self.width, generator=g).to(torch_dtype(self.dtype))
        return torch.randint(0, self.vocab, (self.rows, self.cols), generator=g), table


def _host_embedding_strategy():
    import hypothesis.strategies as st

    return st.builds(HostEmbeddingCase, vocab=st.integers(1, 300), width=st.sampled_from([1, 7, 64, 1030, 2048]),
                     rows=st.integers(0, 3), cols=st.integers(1, 9), dtype=st.sampled_from(["bfloat16", "float32"]),
                     seed=st.integers(0, 2**31 - 1))


def _host_embedding_kernel(case: HostEmbeddingCase, device: str):
    from freetoken.kernels.triton.host_embedding import gather_rows

    ids, table = case.inputs()
    return gather_rows(ids.to(device), table.pin_memory() if device == "cuda" else table).cpu()


def _host_embedding_twin(case: HostEmbeddingCase):
    from freetoken.kernels.triton.host_embedding import gather_rows_twin

    return gather_rows_twin(*case.inputs())


register_kernel(KernelSpec(
    name="host_embedding", strategy=_host_embedding_strategy, kernel=_host_embedding_kernel,
    twin=_host_embedding_twin, guarantee=BIT_EXACT, max_examples=15,
    doc="kernels/triton/host_embedding.py: token embedding rows gathered from a pinned host table",
))


@dataclass(frozen=True)
class PlanPostCase:
    """A sequence of plans (a `PlanCase`), each followed by its layer's fused hand-off: the plan
    kernel posting the CPU work itself (`plan_layer_device(..., handoff=)`)."""

    plan: object  # PlanCase (kernels/specs/plan.py)
    hidden: int
    dtype: str
    fills: bool  # hand the plan's background fills over
    tickets: bool  # ... numbered with fill tickets (LANDED far ahead: no wait blocks)
    always_every: int  # every this many steps the layer rings without CPU work (a step's last layer)
    seed: int


_MAILBOX_ROWS = 10  # more than a plan case's rows: the kernel writes the first N only


def _plan_post_strategy():
    from hypothesis import strategies as st

    from freetoken.kernels.specs.plan import plan_strategy

    @st.composite
    def cases(draw: Callable) -> PlanPostCase:
        fills = draw(st.booleans())
        return PlanPostCase(draw(plan_strategy()), draw(st.sampled_from([8, 100, 2048])),
                            draw(st.sampled_from(["bfloat16", "float32"])), fills, fills and draw(st.booleans()),
                            draw(st.sampled_from([1, 3, 1000])), draw(st.integers(0, 2**31 - 1)))

    return cases()


def _plan_post_run(case: PlanPostCase, device: str, plan_step) -> list:
    """Run the case's plans through `plan_step(layer, ids, rule, ratio, handoff) -> plan record`,
    recording after each the plan and the mailbox: rows, fill rows, tickets, bell."""
    import torch

    g = torch.Generator().manual_seed(case.seed)
    k = len(case.plan.steps[0][1][0])
    s = case.plan.num_slots
    mx = torch.zeros(_MAILBOX_ROWS, case.hidden, device=device)
    mw = torch.zeros(_MAILBOX_ROWS, k, device=device)
    mf, ms, mc = (torch.full((_MAILBOX_ROWS, k), -7, dtype=torch.int32, device=device) for _ in range(3))
    words = torch.zeros(s + 2, dtype=torch.int32, device=device)
    landed = torch.tensor([1 << 20], dtype=torch.int32, device=device)
    bell = torch.zeros(1, dtype=torch.int32, device=device)
    out = []
    for i, (layer, ids, rule, ratio) in enumerate(case.plan.steps):
        n = len(ids)
        x = (torch.randn(n, case.hidden, generator=g) * 3).to(torch_dtype(case.dtype)).to(device)
        weights = torch.rand(n, k, generator=g).to(torch_dtype(case.dtype)).to(device)
        handoff = dict(x=x, weights=weights, mx=mx, mw=mw, mf=mf, bell=(bell, 7 + i), always=i % case.always_every == 0,
                       fill_rows=(ms, mc) if case.fills else None, tickets=(words, landed) if case.tickets else None)
        record = plan_step(layer, ids, rule, ratio, handoff)
        out.append([record, *(t.cpu().clone() for t in (mx, mw, mf, ms, mc, words, bell))])
    return out


def _plan_post_kernel(case: PlanPostCase, device: str) -> list:
    import torch

    from freetoken.kernels.device_cache_state import DeviceCacheState
    from freetoken.kernels.specs.plan import TALLY_START, plan_record
    from freetoken.kernels.triton.cpu_handoff import PlanHandoff
    from freetoken.kernels.triton.plan import plan_layer_device

    plan_case = case.plan
    state = DeviceCacheState.from_reference(plan_case.initial_state(), device)
    rows = torch.full((plan_case.num_layers, 6), TALLY_START, dtype=torch.int64, device=device)

    def step(layer, ids, rule, ratio, handoff) -> dict:
        ids_t = torch.tensor(ids, device=device)
        p = plan_layer_device(state, layer, ids_t, rule, ratio, tally=rows[layer] if plan_case.tally else None,
                              handoff=PlanHandoff(**handoff))
        return plan_record(p.routes.tolist(), p.copy_slots.tolist(), p.copy_fids.tolist(),
                           p.background_slots.tolist(), p.counts.tolist(), state.to_reference(),
                           rows[layer].tolist() if plan_case.tally else None)

    return _plan_post_run(case, device, step)


def _plan_post_twin(case: PlanPostCase) -> list:
    import torch

    from freetoken.kernels.specs.plan import plan_twin
    from freetoken.kernels.triton.cpu_handoff import post_cpu_work_torch

    records = iter(plan_twin(case.plan))  # the plan's twin, step by step
    num_experts = case.plan.num_experts

    def step(layer, ids, rule, ratio, h) -> dict:
        record = next(records)
        routes = torch.tensor(record["routes"], dtype=torch.int32)
        background = torch.tensor(record["background_slots"], dtype=torch.int32)
        fids = torch.tensor(record["copy_fids"], dtype=torch.int32)
        copies = torch.tensor(record["copy_slots"], dtype=torch.int32)
        fills = (background, fids, *h["fill_rows"]) if h["fill_rows"] is not None else None
        tickets = (h["tickets"][0], copies, h["tickets"][1]) if h["tickets"] is not None else None
        post_cpu_work_torch(h["x"], h["weights"], torch.tensor(ids), routes, layer * num_experts, h["mx"], h["mw"],
                            h["mf"], bell=h["bell"], always=h["always"], fills=fills, tickets=tickets)
        return record

    return _plan_post_run(case, "cpu", step)


register_kernel(KernelSpec(
    name="plan_post", strategy=_plan_post_strategy, kernel=_plan_post_kernel, twin=_plan_post_twin,
    guarantee=BIT_EXACT, max_examples=6,
    doc="kernels/triton/plan.py with the fused hand-off after the plan vs the plan's twin then the hand-off's "
        "(mailbox rows, background fills handed over and numbered, the bell), every step of a plan sequence",
))
