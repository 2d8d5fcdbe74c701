"""Serving counters and gauges, kept by the Scheduler on the event loop (no locks needed) and
read by `AsyncLLM.metrics()` for GET /metrics.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

HELP = {
    "requests_total": "Requests submitted.",
    "requests_finished_total": "Requests that finished (stop, length, or client gone).",
    "requests_failed_total": "Requests that ended in an engine error.",
    "prompt_tokens_total": "Prompt tokens submitted.",
    "cached_prompt_tokens_total": "Prompt tokens whose KV was reused instead of prefilled.",
    "generation_tokens_total": "Tokens generated.",
    "running_requests": "Sequences admitted (holding KV pages).",
    "waiting_requests": "Requests queued for admission (queue depth).",
    "decode_tokens_per_second": "Tokens per second over the last decode steps (all sequences).",
    "time_to_first_token_seconds": "From submission to the first token.",
    # expert hierarchy counters, added by AsyncLLM.metrics() from the model runner
    "expert_cache_hits_total": "Routed experts found in the GPU slot cache.",
    "expert_cache_misses_total": "Routed experts not in the GPU slot cache.",
    "experts_fetched_total": "Experts copied from the host pool into slots.",
    "pcie_bytes_total": "Expert bytes copied host-to-device by decode steps' plans.",
    "prefill_stream_pcie_bytes_total": "Expert bytes prefill streaming copied host-to-device (the experts the "
                                       "decode cache held are copied on the GPU instead).",
    "cpu_expert_routes_total": "Token routes computed by the CPU expert executor.",
    "expert_cache_hit_rate": "Hits over lookups since start.",
    "expert_slots": "GPU expert slots.",
    "kv_tokens": "KV cache capacity in tokens (all pages).",
    "expert_link_bytes_per_second": "Expert bytes per second over PCIe fills and on the CPU: live (median of "
                                    "recent timed work) and the bandwidth profile's figure the split came from.",
    "expert_split_pcie_share": "The share of a layer's cache misses fetched over PCIe (hybrid's r; with "
                               "--moe-policy auto the running mode's: 1 transfer, 0 cpu).",
    "expert_split_estimate_bytes_per_second": "The live split's estimate of each link (the median of recent "
                                              "steps' rates), which its share follows.",
    "cpu_expert_threads": "Threads the CPU expert executor runs with now (with the live split, they follow "
                          "the cores other processes leave free).",
    "moe_policy_mode": "--moe-policy auto: 1 for the mode it runs now (transfer, hybrid or cpu), 0 for the others.",
    "moe_policy_probes_total": "--moe-policy auto: probes (a few steps of each mode, timed) since start.",
    "moe_policy_switches_total": "--moe-policy auto: probes whose choice changed the mode.",
    "moe_policy_mode_steps_total": "--moe-policy auto: decode steps run in each mode.",
}


@dataclass
class EngineMetrics:
    requests_total: int = 0
    requests_finished_total: int = 0
    requests_failed_total: int = 0
    prompt_tokens_total: int = 0
    cached_prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    ttft_counts: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))
    ttft_sum: float = 0.0
    _decode_window: deque = field(default_factory=lambda: deque(maxlen=32))  # (seconds, tokens) per step

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_counts[bisect.bisect_left(TTFT_BUCKETS, seconds)] += 1
        self.ttft_sum += seconds

    def observe_decode(self, seconds: float, tokens: int) -> None:
        self._decode_window.append((seconds, tokens))

    def decode_rate(self) -> float:
        seconds = sum(s for s, _ in self._decode_window)
        return sum(t for _, t in self._decode_window) / seconds if seconds > 0 else 0.0

    def snapshot(self, running: int, waiting: int) -> dict:
        cumulative, buckets = 0, []
        for le, count in zip((*TTFT_BUCKETS, float("inf")), self.ttft_counts, strict=True):
            cumulative += count
            buckets.append((le, cumulative))
        return {
            "counters": {name: getattr(self, name) for name in (
                "requests_total", "requests_finished_total", "requests_failed_total", "prompt_tokens_total",
                "cached_prompt_tokens_total", "generation_tokens_total")},
            "gauges": {"running_requests": running, "waiting_requests": waiting,
                       "decode_tokens_per_second": self.decode_rate()},
            "histograms": {"time_to_first_token_seconds": {
                "buckets": buckets, "sum": self.ttft_sum, "count": cumulative}},
            "help": dict(HELP),
        }
