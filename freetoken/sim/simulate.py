"""Replay a routing trace through the expert cache's policies and count where experts ran.

Every record of the trace (or, for an ids array [T, L, K], every (token, layer) in decode order)
is one plan of the reference specification (`freetoken.reference.expert_cache.plan_layer`),
applied to one `CacheState` shared by all layers. Counting, per plan:
- hits / misses: distinct routed experts found in / absent from the slot cache;
- fetched: misses copied into the cache over PCIe (expert_bytes each);
- CPU experts: misses left to the CPU (misses - fetched); the CPU reads each one's weights
  once per plan (expert_bytes each), however many of the plan's tokens route to it;
- CPU routes: (token, expert) pairs that run on the CPU (route -1).
"Per token" divides by the number of tokens that went through every layer: token rows of the
trace / number of traced layers.

Policies and initial placement:
- resident: every expert is placed before the first plan; needs cache_slots >= L*E.
- static: whole layers are placed, as many as fit (cache_slots // E); mirroring llama.cpp's
  `--n-cpu-moe N`, which keeps the MoE weights of the first N layers on the CPU, the CPU
  keeps the FIRST layers and the GPU holds the LAST ones. Nothing moves afterwards.
- transfer, cpu, hybrid: start empty; the plan decides (hybrid splits misses by the ratio).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from freetoken.moe.policy import POLICIES, make_policy, sim_policy
from freetoken.reference.expert_cache import CacheState, plan_layer, share_q16
from freetoken.reference.fetch_rule import FetchRule
from freetoken.trace.routing import RoutingReplay, RoutingTrace, TraceError

# Qwen3-30B-A3B: gate, up and down projections of hidden 2048 x expert intermediate 768, bf16.
DEFAULT_EXPERT_BYTES = 3 * 2048 * 768 * 2
DEFAULT_RATIO = 0.5
DEFAULT_FRACTIONS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def ratio_q16(ratio: float) -> int:
    """The hybrid split ratio r = B_pcie / (B_pcie + B_cpu) in Q16; a bad ratio is a TraceError."""
    try:
        return share_q16(ratio)
    except ValueError as exc:
        raise TraceError(str(exc)) from exc


@dataclass
class SimResult:
    policy: str
    num_layers: int
    num_experts: int
    cache_slots: int
    ratio: float
    expert_bytes: int
    tokens: float  # tokens counted (after warm-up), each through every traced layer
    plans: int
    hits: int
    misses: int
    fetched: int
    cpu_experts: int
    cpu_routes: int
    gpu_layers: list[int] = field(default_factory=list)  # static: layers held on the GPU
    layer_hits: list[int] = field(default_factory=list)
    layer_misses: list[int] = field(default_factory=list)

    def _per_token(self, n: float) -> float:
        return n / self.tokens if self.tokens else 0.0

    @property
    def hit_rate(self) -> float:
        routed = self.hits + self.misses
        return self.hits / routed if routed else 0.0

    @property
    def miss_rate(self) -> float:
        routed = self.hits + self.misses
        return self.misses / routed if routed else 0.0

    @property
    def misses_per_token(self) -> float:
        return self._per_token(self.misses)

    @property
    def fetched_per_token(self) -> float:
        return self._per_token(self.fetched)

    @property
    def cpu_routes_per_token(self) -> float:
        return self._per_token(self.cpu_routes)

    @property
    def cpu_experts_per_token(self) -> float:
        return self._per_token(self.cpu_experts)

    @property
    def pcie_bytes_per_token(self) -> float:
        return self._per_token(self.fetched * self.expert_bytes)

    @property
    def cpu_bytes_per_token(self) -> float:
        return self._per_token(self.cpu_experts * self.expert_bytes)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in (
            "hit_rate",
            "miss_rate",
            "misses_per_token",
            "fetched_per_token",
            "cpu_routes_per_token",
            "cpu_experts_per_token",
            "pcie_bytes_per_token",
            "cpu_bytes_per_token",
        ):
            d[name] = getattr(self, name)
        return d


def trace_plans(
    trace: Any, num_layers: int, num_experts: int, remap: bool
) -> tuple[list[tuple[int, list[list[int]]]], int]:
    """(layer, token rows) per plan in order, and the number of traced layers."""
    if num_layers <= 0 or num_experts <= 0:
        raise TraceError(f"num_layers and num_experts must be positive, got {num_layers}, {num_experts}")
    if isinstance(trace, (str, Path)):
        trace = RoutingTrace.load(trace)
    if isinstance(trace, RoutingTrace):
        if not trace.records:
            raise TraceError("routing trace has no records")
        if remap:
            replay = RoutingReplay(trace, num_layers, num_experts)
            by_layer = trace.tokens_by_layer()
            tokens = max(len(by_layer[t]) for t in set(replay.layer_map))
            k = min(trace.top_k, num_experts)
            plans = [
                (layer, replay.ids_for(layer, 1, k)) for _ in range(tokens) for layer in range(num_layers)
            ]
            return plans, num_layers
        plans = [(r.layer, r.experts) for r in trace.records]
    else:
        ids = np.asarray(trace)
        if ids.ndim != 3:
            raise TraceError(f"ids must be [tokens, layers, top_k], got shape {ids.shape}")
        if remap:
            raise TraceError("remap applies to routing traces; generate ids in the model's shape instead")
        rows = ids.tolist()
        plans = [(layer, [rows[t][layer]]) for t in range(ids.shape[0]) for layer in range(ids.shape[1])]
    if not plans:
        raise TraceError("the trace has no tokens")
    layers = {layer for layer, _ in plans}
    top_layer = max(layers)
    top_expert = max(e for _, rows in plans for row in rows for e in row)
    if top_layer >= num_layers or top_expert >= num_experts:
        raise TraceError(
            f"the trace has layer {top_layer} and expert id {top_expert}, outside a model of {num_layers} "
            f"layers x {num_experts} experts; pass the trace's shape, or remap it (remap=True, --remap)"
        )
    return plans, len(layers)


def initial_state(
    policy: str, num_layers: int, num_experts: int, cache_slots: int
) -> tuple[CacheState, list[int]]:
    """The cache before the first plan (the experts of the layers the policy places: every one for
    resident, whole last layers for static, none otherwise) and those layers."""
    if policy not in POLICIES:
        raise TraceError(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")
    if cache_slots < 0:
        raise TraceError(f"cache_slots must be >= 0, got {cache_slots}")
    state = CacheState(num_layers, num_experts, cache_slots)
    try:
        gpu_layers = make_policy(policy).gpu_layers(list(range(num_layers)), cache_slots, num_experts)
    except ValueError as exc:
        raise TraceError(str(exc)) from None
    fids = [layer * num_experts + e for layer in gpu_layers for e in range(num_experts)]
    for slot, fid in enumerate(fids):
        state.place(fid, slot)
    return state, gpu_layers


def simulate(
    trace: Any,
    num_layers: int,
    num_experts: int,
    cache_slots: int,
    policy: str,
    ratio: float = DEFAULT_RATIO,
    expert_bytes: int = DEFAULT_EXPERT_BYTES,
    warmup_tokens: int = 0,
    remap: bool = False,
    fetch_recurring: bool = True,
    background_fills: bool = True,
) -> SimResult:
    """Replay `trace` (a RoutingTrace, a trace file, or ids [T, L, K]) through `policy`.

    `ratio`, `fetch_recurring` and `background_fills` only matter for hybrid. The first `warmup_tokens` token rows of
    every layer go through the cache but are not counted. `remap` replays a trace of another shape through
    `RoutingReplay` (one token at a time, decode order).
    """
    plans, traced_layers = trace_plans(trace, num_layers, num_experts, remap)
    return _run(
        plans, traced_layers, num_layers, num_experts, cache_slots, policy, ratio, expert_bytes, warmup_tokens,
        fetch_recurring, background_fills,
    )


def _run(
    plans: Sequence[tuple[int, list[list[int]]]],
    traced_layers: int,
    num_layers: int,
    num_experts: int,
    cache_slots: int,
    policy: str,
    ratio: float,
    expert_bytes: int,
    warmup_tokens: int,
    fetch_recurring: bool = True,
    background_fills: bool = True,
) -> SimResult:
    r16 = ratio_q16(ratio)
    state, gpu_layers = initial_state(policy, num_layers, num_experts, cache_slots)
    rule = sim_policy(policy, fetch_recurring, background_fills).fetch_rule
    res = SimResult(
        policy,
        num_layers,
        num_experts,
        cache_slots,
        ratio,
        expert_bytes,
        0.0,
        0,
        0,
        0,
        0,
        0,
        0,
        gpu_layers,
        [0] * num_layers,
        [0] * num_layers,
    )
    seen = [0] * num_layers
    rows_counted = 0
    for layer, rows in plans:
        plan = plan_layer(state, layer, rows, rule, r16)
        counted = seen[layer] >= warmup_tokens
        seen[layer] += len(rows)
        if not counted:
            continue
        rows_counted += len(rows)
        res.plans += 1
        res.hits += plan.hits
        res.misses += plan.misses
        res.fetched += plan.fetched
        res.cpu_experts += plan.on_cpu
        res.cpu_routes += sum(1 for row in plan.routes for s in row if s < 0)
        res.layer_hits[layer] += plan.hits
        res.layer_misses[layer] += plan.misses
    res.tokens = rows_counted / traced_layers
    return res


def _run_args(args: tuple[Any, ...]) -> SimResult:
    return _run(*args)


def sweep(
    trace: Any,
    num_layers: int,
    num_experts: int,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    policies: Sequence[str] = POLICIES,
    ratio: float = DEFAULT_RATIO,
    expert_bytes: int = DEFAULT_EXPERT_BYTES,
    warmup_tokens: int = 0,
    remap: bool = False,
    out_prefix: str | Path | None = None,
    workers: int = 1,
    fetch_recurring: bool = True,
) -> dict[str, Any]:
    """Miss rate (and traffic) against cache size for every policy.

    Cache sizes are fractions of the expert pool (L*E), rounded to whole slots. `resident` is
    only defined where the cache holds the whole pool; elsewhere its entry is None. With
    `out_prefix`, writes `<out_prefix>.json` and a plot `<out_prefix>.png`.

    Runs that must give the same result are done once: `cpu` never fills the cache (one run
    for all sizes), `static` depends only on how many whole layers fit. `workers` > 1 runs
    the distinct simulations in that many processes (each plan costs O(cache_slots) in the
    reference, so large pools take a while).
    """
    for p in policies:
        if p not in POLICIES:
            raise TraceError(f"unknown policy {p!r}; one of {', '.join(POLICIES)}")
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        raise TraceError(f"fractions must be in (0, 1], got {list(fractions)}")
    plans, traced_layers = trace_plans(trace, num_layers, num_experts, remap)
    pool = num_layers * num_experts
    slots = [max(0, min(pool, round(f * pool))) for f in fractions]

    def key(name: str, s: int) -> tuple[str, int] | None:
        policy = make_policy(name)
        if policy.every_expert:
            return None if s < pool else (name, pool)
        if policy.fixed_placement:  # only the whole layers that fit count
            return (name, min(num_layers, s // num_experts) * num_experts)
        if policy.fetch_rule is FetchRule.NONE:  # the cache never fills: its size does not matter
            return (name, 0)
        return (name, s)

    jobs = sorted({k for p in policies for s in slots if (k := key(p, s)) is not None})
    args = [
        (plans, traced_layers, num_layers, num_experts, s, p, ratio, expert_bytes, warmup_tokens, fetch_recurring)
        for p, s in jobs
    ]
    if workers > 1 and len(jobs) > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=min(workers, len(jobs))) as ex:
            done = list(ex.map(_run_args, args))
    else:
        done = [_run_args(a) for a in args]
    results = dict(zip(jobs, done, strict=True))
    table: dict[str, list[dict[str, Any] | None]] = {}
    tokens = done[0].tokens if done else 0.0
    for policy in policies:
        rows: list[dict[str, Any] | None] = []
        for f, s in zip(fractions, slots, strict=True):
            k = key(policy, s)
            if k is None:
                rows.append(None)
                continue
            r = results[k]
            rows.append(
                {
                    "fraction": f,
                    "cache_slots": s,
                    "hit_rate": r.hit_rate,
                    "miss_rate": r.miss_rate,
                    "misses_per_token": r.misses_per_token,
                    "fetched_per_token": r.fetched_per_token,
                    "cpu_routes_per_token": r.cpu_routes_per_token,
                    "pcie_bytes_per_token": r.pcie_bytes_per_token,
                    "cpu_bytes_per_token": r.cpu_bytes_per_token,
                }
            )
        table[policy] = rows
    out = {
        "num_layers": num_layers,
        "num_experts": num_experts,
        "pool": pool,
        "ratio": ratio,
        "fetch_recurring": fetch_recurring,
        "expert_bytes": expert_bytes,
        "warmup_tokens": warmup_tokens,
        "tokens": tokens,
        "fractions": list(fractions),
        "cache_slots": slots,
        "policies": table,
    }
    if out_prefix is not None:
        write_sweep(out, out_prefix)
    return out


def _series(result: dict[str, Any]) -> Iterator[tuple[str, list[tuple[float, float] | None]]]:
    for policy, rows in result["policies"].items():
        yield policy, [None if r is None else (r["fraction"], r["miss_rate"]) for r in rows]


def write_sweep(result: dict[str, Any], out_prefix: str | Path) -> tuple[Path, Path]:
    """Write a sweep's table as JSON and its miss-rate curves as a PNG; returns both paths."""
    from freetoken.plot import line_plot

    prefix = Path(out_prefix)
    json_path = prefix.with_name(prefix.name + ".json")
    png_path = prefix.with_name(prefix.name + ".png")
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    line_plot(
        png_path,
        dict(_series(result)),
        title=f"miss rate vs cache size  L={result['num_layers']} E={result['num_experts']} "
        f"r={result['ratio']:g}",
        x_label="cache slots / pool",
        y_label="miss rate",
        x_range=(0.0, 1.0),
        y_range=(0.0, 1.0),
        x_percent=True,
    )
    return json_path, png_path


def format_table(result: dict[str, Any]) -> str:
    """The sweep as a text table: miss rate per policy per cache size."""
    policies = list(result["policies"])
    head = f"{'cache':>6} {'slots':>7} " + " ".join(f"{p:>9}" for p in policies)
    lines = [head]
    for i, (f, s) in enumerate(zip(result["fractions"], result["cache_slots"], strict=True)):
        cells = []
        for p in policies:
            r = result["policies"][p][i]
            cells.append(f"{'-':>9}" if r is None else f"{r['miss_rate']:>9.3f}")
        lines.append(f"{f:>6.0%} {s:>7} " + " ".join(cells))
    return "\n".join(lines)
