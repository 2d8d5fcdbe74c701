"""The MoE backend over the expert hierarchy: slot cache hits on the GPU, misses split between
PCIe fills and CPU execution by the policy.

It only chooses who runs a layer: the captured executor (moe/captured_layer.py) while the
decode graphs run a step to capture, else the eager one (moe/eager_layer.py). Both execute the
same plan with the same kernels. The CPU and GPU partial sums are each exact sums of
per-expert terms, so any placement gives the same output up to the order of floating-point
additions. Both feed the live bandwidth estimates (cache/live_bandwidth.py) in `live`.
"""

from __future__ import annotations

import torch

from freetoken.cache.live_bandwidth import LiveBandwidths
from freetoken.cache.prefill_stream import LayerStreamer, StreamCounts
from freetoken.cache.slot_cache import SlotCache
from freetoken.moe.captured_layer import CapturedLayer
from freetoken.moe.eager_layer import EagerLayer
from freetoken.moe.slot_gemm import GemmFn
from freetoken.trace import NULL_RECORDER, TraceRecorder


class OffloadedExperts:
    def __init__(
        self,
        cache: SlotCache,
        executor,
        gemms: list[GemmFn],  # per layer, the pool's expert format's GEMM over slots (moe/expert_format.py)
        recorder: TraceRecorder = NULL_RECORDER,
        stream_min_tokens: int | None = 64,
        cpu_branch: str = "worker",
    ) -> None:
        """stream_min_tokens: forwards with at least this many tokens (prefill chunks) stream
        whole layers (cache/prefill_stream.py) instead of planning per expert; None: never.
        cpu_branch: the eager layer's CPU branch, "worker" or "inline" (moe/eager_layer.py)."""
        self.copy_stream = torch.cuda.Stream() if cache.device == "cuda" else None
        self.live = LiveBandwidths()
        self.live.sources = {
            "pcie_fill": "eager fills: CUDA events around each layer's slot copies on the copy stream"
            if self.copy_stream is not None else "eager fills: host time of each layer's slot copies (a CPU "
            "device: a memory copy, no PCIe)",
            "cpu_expert": "eager CPU calls: each layer's distinct CPU experts over the executor's time for the call",
        }
        self.eager = EagerLayer(executor, gemms, recorder, self.copy_stream, stream_min_tokens, cpu_branch, self.live)
        self.captured = CapturedLayer(gemms, recorder)
        self.stream_min_tokens = stream_min_tokens
        self.stream_counts = StreamCounts()
        self.cache = cache
        # Set by the decode graphs while they run a step to capture (engine/decode_graphs.py):
        # the layer then runs without host synchronisation, its CPU branch through the doorbell.
        self.graph_plane = None

    @property
    def cache(self) -> SlotCache:
        return self._cache

    @cache.setter
    def cache(self, cache: SlotCache | None) -> None:
        """A new slot cache (live resize) gets its own prefill streamer."""
        self._cache = cache
        self.streamer = None
        # (a fixed placement never fetches: streaming through its slots would evict it for good)
        if cache is not None and cache.policy.streams_prefill and self.stream_min_tokens is not None:
            streamer = LayerStreamer(cache, self.copy_stream, self.stream_counts)
            self.streamer = streamer if streamer.available else None

    def experts(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.graph_plane is not None:
            return self.captured.run(self.cache, self.graph_plane, layer, x, weights, ids)
        return self.eager.run(self.cache, self.streamer, layer, x, weights, ids)

    def live_status(self) -> dict:
        """The live bandwidth estimates (LiveBandwidths.status), eager fills that have passed included."""
        self.eager.collect_fill_timings()
        return self.live.status()
