"""Device time of a callable by CUDA events: the median over repeats, after warm-up calls."""

from __future__ import annotations

import statistics


def median_event_ms(fn, repeats: int = 10, warmup: int = 1) -> float:
    """Milliseconds between events recorded around fn(), the median of `repeats` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
