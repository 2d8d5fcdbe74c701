"""Time a decode-size kernel as a captured step runs it: inside a CUDA graph, host launches excluded.

At decode sizes a kernel takes a few microseconds, about what launching it from Python costs, so
`triton.testing.do_bench` (host launches, an L2 flush between calls) measures mostly the host.
"""

from __future__ import annotations

import torch

CALLS, REPLAYS = 32, 10


def graph_us(fn, calls: int = CALLS, replays: int = REPLAYS) -> float:
    """Microseconds per call of fn(i) for i in 0..calls-1, captured once and replayed `replays`
    times (fn(i) should touch different data for different i, as a step's layers do)."""
    for i in range(calls):  # compile and warm outside the capture
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)
