"""Synthetic routing traces with tunable popularity skew and token-to-token reuse.

Model of one layer's routing (layers are independent, each with its own random stream):
- popularity: expert of rank r (0 = hottest) has weight (r + 1) ** -skew; a per-layer random
  permutation decides which expert holds which rank, so hot experts differ between layers.
- each token picks `top_k` distinct experts, one at a time: with probability `reuse` the pick
  repeats an expert chosen at this layer by one of the previous `window` tokens (uniformly
  over those tokens' selections, so an expert chosen by several of them is likelier), else it
  is drawn by popularity among the experts not yet picked (successive sampling without
  replacement, done with Gumbel keys).

`calibrated` gives presets fitted to measured routing statistics, and `trace_stats` reports,
for any trace, the statistics those measurements use, so a run can say which regime it is in.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from freetoken.trace.routing import RoutingRecorder, RoutingTrace, TraceError

# ---------------------------------------------------------------------------------------------
# Calibration constants.
#
# Popularity: OLMoE routing statistics, Apache-2.0 (allenai/OLMoE, scripts/routing_output,
# expert_counts of allenai/OLMoE-1B-7B-0924 at layers 0, 7 and 15 over ~205k tokens each of the
# arxiv, book, c4, github, tulu and wikipedia domains; and of mistralai/Mixtral-8x7B-v0.1 at
# the same layers over arxiv, book, c4, github and wikipedia). For each (domain, layer), sort
# the experts by selection count and count how many it takes to cover half of all selections:
#   OLMoE (64 experts, top-8): 8..27 experts, median 16; with linear interpolation inside the
#     crossing expert the median is 15.42 of 64. Mean popularity entropy 5.55 bits (max 6).
#   Mixtral (8 experts, top-2): always 4 (integer); 3.66 of 8 interpolated (median); mean
#     popularity entropy 2.98 bits (max 3).
OLMOE_HALF_COVER = 16  # of 64 experts: median over 6 domains x 3 layers
OLMOE_HALF_COVER_RANGE = (8, 27)
OLMOE_HALF_COVER_FRACTION = 15.42 / 64  # interpolated median, the preset's fitting target
OLMOE_ENTROPY_BITS = 5.55
MIXTRAL_HALF_COVER_FRACTION = 3.66 / 8
MIXTRAL_ENTROPY_BITS = 2.98
#
# Reuse: measured on a Mixtral-8x7B-Instruct greedy decode trace (585 tokens x 32 layers,
# HumanEval and GSM8K prompts): the share of a token's experts (per layer) that any of the
# previous 1 / 2 / 4 / 8 tokens also used at that layer.
MIXTRAL_REUSE_SHARE = {1: 0.376, 2: 0.540, 4: 0.716, 8: 0.887}
# (reuse, window) fitted on the mixtral preset (8 experts, top-2, skew fitted as above, 20k
# tokens x 8 layers): for each window 1..4, reuse bisected so that the previous-token share is
# 0.376 (window 2: reuse 0.303, kept as 0.30), then the window with the least total squared
# error over the other six figures: the 2/4/8-token shares and the hit rate of one global LRU
# over the 256 (layer, expert) pairs at 25/50/75% of 256 slots (585 tokens x 32 layers;
# measured 0.37 / 0.56 / 0.80). Window 2 gives shares 0.374 / 0.577 / 0.717 / 0.871 and LRU
# hits 0.374 / 0.597 / 0.804; window 1 (reuse 0.174) gives 0.376 / 0.507 / 0.693 / 0.879 and
# 0.377 / 0.507 / 0.762. The olmoe preset uses the same (reuse, window): no token-order data
# exists for OLMoE, and the per-pick repeat probability is the knob that transfers.
MIXTRAL_REUSE = 0.30
MIXTRAL_WINDOW = 2
# ---------------------------------------------------------------------------------------------

PRESETS = ("olmoe", "mixtral", "uniform")
_PRESET_SHAPES = {"olmoe": (16, 64, 8), "mixtral": (32, 8, 2), "uniform": (16, 64, 8)}
REUSE_WINDOWS = (1, 2, 4, 8)


@dataclass(frozen=True)
class SyntheticConfig:
    num_layers: int
    num_experts: int
    top_k: int
    num_tokens: int
    skew: float = 0.0
    reuse: float = 0.0
    window: int = 4
    seed: int = 0

    def check(self) -> None:
        if self.num_layers <= 0 or self.num_experts <= 0 or self.num_tokens < 0:
            raise TraceError("num_layers and num_experts must be positive, num_tokens >= 0")
        if not 0 < self.top_k <= self.num_experts:
            raise TraceError(f"top_k must be in 1..{self.num_experts}, got {self.top_k}")
        if self.skew < 0:
            raise TraceError(f"skew must be >= 0, got {self.skew}")
        if not 0.0 <= self.reuse <= 1.0:
            raise TraceError(f"reuse must be in [0, 1], got {self.reuse}")
        if self.window < 1:
            raise TraceError(f"window must be >= 1, got {self.window}")


def rank_popularity(num_experts: int, skew: float) -> np.ndarray:
    """Zipf-like weights by rank, normalised: p[r] proportional to (r + 1) ** -skew."""
    w = np.arange(1, num_experts + 1, dtype=np.float64) ** -float(skew)
    return w / w.sum()


def _layer_rng(seed: int, layer: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(layer), 0x5EED])


def generate(cfg: SyntheticConfig) -> np.ndarray:
    """Expert ids, int32 [num_tokens, num_layers, top_k]; rows are distinct; deterministic in cfg."""
    cfg.check()
    T, L, E, K = cfg.num_tokens, cfg.num_layers, cfg.num_experts, cfg.top_k
    out = np.empty((T, L, K), dtype=np.int32)
    logp_rank = np.log(rank_popularity(E, cfg.skew))
    depth = min(E, 2 * K)  # picks skip at most K - 1 experts already taken by reuse
    chunk = max(1, (1 << 20) // E)
    for layer in range(L):
        rng = _layer_rng(cfg.seed, layer)
        logp = np.empty(E)
        logp[rng.permutation(E)] = logp_rank  # expert perm[r] has rank r
        u_reuse = rng.random((T, K))
        u_pick = rng.random((T, K))
        recent: deque[list[int]] = deque(maxlen=cfg.window)
        for t0 in range(0, T, chunk):
            n = min(chunk, T - t0)
            keys = logp + rng.gumbel(size=(n, E))
            if depth < E:
                top = np.argpartition(-keys, depth - 1, axis=1)[:, :depth]
            else:
                top = np.broadcast_to(np.arange(E), (n, E))
            order = np.take_along_axis(top, np.argsort(-np.take_along_axis(keys, top, 1), 1), 1).tolist()
            for i in range(n):
                t = t0 + i
                by_pop = order[i]
                pos = 0
                row: list[int] = []
                taken: set[int] = set()
                for j in range(K):
                    e = -1
                    if recent and u_reuse[t, j] < cfg.reuse:
                        cands = [x for prev in recent for x in prev if x not in taken]
                        if cands:
                            e = cands[int(u_pick[t, j] * len(cands))]
                    if e < 0:
                        while by_pop[pos] in taken:
                            pos += 1
                        e = by_pop[pos]
                        pos += 1
                    row.append(e)
                    taken.add(e)
                out[t, layer] = row
                recent.append(row)
    return out


def _selection_half_cover_fraction(counts: np.ndarray) -> float:
    """Interpolated number of experts (hottest first) covering half the selections, / E."""
    v = np.sort(np.asarray(counts, dtype=np.float64))[::-1]
    cs = np.cumsum(v) / v.sum()
    i = int(np.searchsorted(cs, 0.5))
    prev = cs[i - 1] if i > 0 else 0.0
    return (i + (0.5 - prev) / (cs[i] - prev)) / len(v)


@lru_cache(maxsize=64)
def fit_skew(num_experts: int, top_k: int, half_cover_fraction: float, samples: int = 0) -> float:
    """The skew at which half of a layer's top-k selections go to `half_cover_fraction` of its
    experts (interpolated), for draws by popularity alone. Monte Carlo with fixed noise and
    bisection: deterministic."""
    if not 0 < half_cover_fraction <= 0.5:
        raise TraceError(f"half_cover_fraction must be in (0, 0.5], got {half_cover_fraction}")
    E, K = num_experts, top_k
    n = samples or max(2000, (1 << 19) // E)
    g = np.random.default_rng(1234).gumbel(size=(n, E))
    base = -np.log(np.arange(1, E + 1, dtype=np.float64))

    def frac(skew: float) -> float:
        keys = skew * base + g
        top = np.argpartition(-keys, K - 1, axis=1)[:, :K] if K < E else np.broadcast_to(np.arange(E), (n, E))
        return _selection_half_cover_fraction(np.bincount(top.ravel(), minlength=E))

    lo, hi = 0.0, 4.0
    if frac(lo) <= half_cover_fraction:
        return 0.0
    for _ in range(24):
        mid = (lo + hi) / 2
        if frac(mid) > half_cover_fraction:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 4)


def calibrated(
    preset: str = "olmoe",
    num_layers: int | None = None,
    num_experts: int | None = None,
    top_k: int | None = None,
    num_tokens: int = 512,
    seed: int = 0,
    **overrides: Any,
) -> SyntheticConfig:
    """A config matching measured routing statistics; shape defaults to the preset's model.

    - "olmoe": half of a layer's selections go to 15.4/64 of its experts (OLMoE's median,
      scaled to `num_experts`); reuse as fitted on Mixtral.
    - "mixtral": Mixtral's near-uniform popularity; reuse and window fitted so that the share of
      a token's experts used by the previous token is 0.376 as measured (previous 2/4/8 tokens:
      about 0.58/0.72/0.87 against the measured 0.540/0.716/0.887).
    - "uniform": no skew, no reuse.
    `overrides` (skew, reuse, window) replace the fitted values.
    """
    if preset not in PRESETS:
        raise TraceError(f"unknown preset {preset!r}; one of {PRESETS}")
    d_layers, d_experts, d_k = _PRESET_SHAPES[preset]
    L = num_layers or d_layers
    E = num_experts or d_experts
    K = top_k or d_k
    if preset == "uniform":
        cfg = SyntheticConfig(L, E, K, num_tokens, skew=0.0, reuse=0.0, window=1, seed=seed)
    else:
        target = OLMOE_HALF_COVER_FRACTION if preset == "olmoe" else MIXTRAL_HALF_COVER_FRACTION
        if not 0 < K <= E:
            raise TraceError(f"top_k must be in 1..{E}, got {K}")
        skew = fit_skew(E, K, target)
        cfg = SyntheticConfig(
            L, E, K, num_tokens, skew=skew, reuse=MIXTRAL_REUSE, window=MIXTRAL_WINDOW, seed=seed
        )
    unknown = set(overrides) - {"skew", "reuse", "window"}
    if unknown:
        raise TraceError(f"unknown override(s) {sorted(unknown)}; allowed: skew, reuse, window")
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    cfg.check()
    return cfg


def write_trace(ids: np.ndarray, path: str | Path, request: str = "synthetic") -> None:
    """Write ids [T, L, K] as a decode routing trace: one record per (token, layer), token-major,
    weights 1/K each."""
    ids = np.asarray(ids)
    if ids.ndim != 3:
        raise TraceError(f"ids must be [tokens, layers, top_k], got shape {ids.shape}")
    T, L, K = ids.shape
    w = [[round(1.0 / K, 6)] * K]
    rows = ids.tolist()
    with RoutingRecorder(path) as rec:
        for t in range(T):
            for layer in range(L):
                rec.record(request, t, layer, "decode", [rows[t][layer]], w)


def _layer_rows(trace: Any) -> list[list[list[int]]]:
    """Token rows per layer (layers in ascending order) from an ids array, trace or path."""
    if isinstance(trace, (str, Path)):
        trace = RoutingTrace.load(trace)
    if isinstance(trace, RoutingTrace):
        by_layer = trace.tokens_by_layer()
        return [by_layer[k] for k in sorted(by_layer)]
    ids = np.asarray(trace)
    if ids.ndim != 3:
        raise TraceError(f"ids must be [tokens, layers, top_k], got shape {ids.shape}")
    return [ids[:, layer, :].tolist() for layer in range(ids.shape[1])]


def trace_stats(
    trace: Any, num_experts: int | None = None, windows: tuple[int, ...] = REUSE_WINDOWS
) -> dict[str, Any]:
    """The routing statistics of a trace (ids [T, L, K], a RoutingTrace, or a trace file path).

    - reuse[w]: share of a token's experts (per layer) also chosen at that layer by any of the
      previous w tokens (tokens with fewer than w predecessors are skipped);
      uniform_reuse[w] is what independent uniform top-k draws would give.
    - entropy_bits: popularity entropy per layer (bits), and its mean.
    - half_cover: per layer, how many experts (hottest first) take half of all selections;
      half_cover_fraction = its mean / num_experts.
    - top_expert_share: the hottest expert's share of selections, mean over layers.
    """
    layers = _layer_rows(trace)
    if not layers or not any(layers):
        raise TraceError("trace has no tokens")
    seen = max(max(max(r) for r in rows) for rows in layers if rows) + 1
    E = num_experts or seen
    if E < seen:
        raise TraceError(f"num_experts={E} but the trace uses expert id {seen - 1}")
    num = {w: 0 for w in windows}
    den = {w: 0 for w in windows}
    entropy, half, top_share, widths, tokens = [], [], [], [], []
    for rows in layers:
        if not rows:
            continue
        T = len(rows)
        tokens.append(T)
        lens = np.fromiter((len(r) for r in rows), dtype=np.int64, count=T)
        widths.append(float(lens.mean()))
        present = np.zeros((T, E), dtype=np.int32)
        present[np.repeat(np.arange(T), lens), np.fromiter((e for r in rows for e in r), dtype=np.int64)] = 1
        csum = np.concatenate([np.zeros((1, E), np.int32), np.cumsum(present, axis=0, dtype=np.int32)])
        for w in windows:
            if T <= w:
                continue
            cur = present[w:]
            recent = (csum[w:T] - csum[0 : T - w]) > 0  # token t: any of tokens t-w..t-1
            num[w] += int((cur.astype(bool) & recent).sum())
            den[w] += int(cur.sum())
        counts = present.sum(axis=0).astype(np.float64)
        p = counts / counts.sum()
        nz = p[p > 0]
        entropy.append(float(-(nz * np.log2(nz)).sum()))
        cs = np.cumsum(np.sort(counts)[::-1])
        half.append(int(np.searchsorted(cs, cs[-1] / 2) + 1))
        top_share.append(float(p.max()))
    k = sum(widths) / len(widths)
    return {
        "layers": len(tokens),
        "tokens_per_layer": int(round(sum(tokens) / len(tokens))),
        "num_experts": E,
        "top_k": round(k, 3),
        "reuse": {w: (num[w] / den[w] if den[w] else None) for w in windows},
        "uniform_reuse": {w: 1.0 - (1.0 - k / E) ** w for w in windows},
        "entropy_bits": sum(entropy) / len(entropy),
        "entropy_bits_per_layer": entropy,
        "max_entropy_bits": math.log2(E),
        "half_cover": sum(half) / len(half),
        "half_cover_per_layer": half,
        "half_cover_fraction": sum(half) / len(half) / E,
        "top_expert_share": sum(top_share) / len(top_share),
    }


def format_stats(stats: dict[str, Any]) -> str:
    """A few readable lines of `trace_stats` output."""
    reuse = " / ".join(f"{v:.3f}" if v is not None else "n/a" for v in stats["reuse"].values())
    uni = " / ".join(f"{v:.3f}" for v in stats["uniform_reuse"].values())
    ws = "/".join(str(w) for w in stats["reuse"])
    return "\n".join(
        [
            f"layers {stats['layers']}, tokens per layer {stats['tokens_per_layer']}, "
            f"experts {stats['num_experts']}, top-k {stats['top_k']:g}",
            f"reused from previous {ws} tokens: {reuse}  (uniform: {uni})",
            f"popularity entropy per layer: {stats['entropy_bits']:.2f} bits "
            f"(max {stats['max_entropy_bits']:.2f})",
            f"experts covering half of selections: {stats['half_cover']:.1f} of {stats['num_experts']} "
            f"({stats['half_cover_fraction']:.1%}); hottest expert {stats['top_expert_share']:.1%}",
        ]
    )


def config_dict(cfg: SyntheticConfig) -> dict[str, Any]:
    return asdict(cfg)
