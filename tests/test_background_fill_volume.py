"""benchmarks/background_fill_volume.py: the link and CPU experts hybrid's plan asks at each r,
replayed through the placement twin (a small synthetic trace)."""

from __future__ import annotations

import random

from benchmarks.background_fill_volume import replay
from freetoken.trace.routing import RoutingRecord, RoutingTrace


def _trace(steps=64, layers=2, experts=32, top_k=4, seed=0):
    rng = random.Random(seed)
    return RoutingTrace([RoutingRecord("r", s, layer, "decode", [rng.sample(range(experts), top_k)],
                                       [[1.0 / top_k] * top_k]) for s in range(steps) for layer in range(layers)])


def test_the_ends_and_no_low_split_cliff():
    trace = _trace()
    transfer = replay(trace, slots=16, ratio=1.0, steps=None)
    assert transfer["background"] == 0 and transfer["cpu_experts"] == 0
    assert transfer["waited"] == transfer["misses"] > 0
    low, mid = replay(trace, 16, 0.1, None), replay(trace, 16, 0.45, None)
    # a lower split waits for fewer fetches and computes more on the CPU; it does not send more over
    # the link (the background takes only what R and Z add, not every miss of a layer q* leaves idle)
    assert low["waited"] < mid["waited"] and low["cpu_experts"] > mid["cpu_experts"]
    assert low["waited"] + low["background"] <= mid["waited"] + mid["background"]
    assert low["cpu_experts"] == low["misses"] - low["waited"]
