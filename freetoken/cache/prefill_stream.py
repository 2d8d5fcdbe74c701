"""Prefill by streaming whole expert layers through two buffers.

A long prompt routes its tokens to nearly every expert of every layer, so caching decisions
stop paying: each layer's experts are copied to the device once per prefill chunk and every
token's experts run there. The two buffers are views of the slot cache's first 2E slots
(layer l uses buffer l % 2): layer l+1 is copied on the copy stream while layer l computes.
Experts the decode cache already holds (in the slots past the buffers) are copied into the
buffer from there, device to device, and stay cached where they are; only the others cross
PCIe, and what the buffers hold afterwards is recorded in the cache. So a prefill moves only
the misses, and the decode after it starts from the cache it had, plus the buffers' layers.
With fewer than 2E slots there is no second buffer: the copy of each layer waits for the
previous layer's compute (one notice says so). Below E slots a layer does not fit; the
caller keeps the per-expert decode path.

Shape legend: N tokens, K top-k, E experts, H hidden.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from freetoken.cache.slot_cache import SlotCache


@dataclass
class StreamCounts:
    """Experts prefill streaming put in its buffers since start (kept across a resize's new streamer)."""

    from_host: int = 0  # over PCIe
    on_device: int = 0  # copied from the decode cache's slots


class LayerStreamer:
    def __init__(self, cache: SlotCache, copy_stream: torch.cuda.Stream | None, counts: StreamCounts) -> None:
        cfg = cache.pool.config
        self.cache = cache
        self.E = cfg.num_experts
        self.sparse_layers = [i for i in range(cfg.num_layers) if cfg.sparse_layers[i]]
        self.copy_stream = copy_stream
        self.buffers = 2 if cache.num_slots >= 2 * self.E else 1 if cache.num_slots >= self.E else 0
        self.keep_from = self.buffers * self.E  # slots past the buffers: the decode cache, kept
        self.ready: dict[int, torch.cuda.Event | None] = {}  # layer -> its copy's completion
        # The cache's slot map at the forward's first layer: its entries past the buffers do not
        # change while the forward streams (claims touch only buffer slots and experts moved into them).
        self.slot_of: list[int] = []
        self.layers_streamed = 0
        self.counts = counts
        if self.buffers == 1:
            print(f"[freetoken] {cache.num_slots} expert slots < 2 x {self.E}: prefill streams one layer at a "
                  "time without overlapping copies and compute", file=sys.stderr)

    @property
    def available(self) -> bool:
        return self.buffers > 0

    def _first_slot(self, layer: int) -> int:
        return (self.sparse_layers.index(layer) % self.buffers) * self.E

    def _start_copy(self, layer: int) -> None:
        first = self._first_slot(layer)
        if self.copy_stream is None:  # host "device": the copy is done when it returns
            self._count(self.cache.fill_layer(layer, first, self.slot_of, self.keep_from))
            self.ready[layer] = None
            return
        # Everything queued so far on the compute stream may read these slots (the previous
        # layer in this buffer, or decode-path GEMMs before this forward) or write the cached
        # experts copied from (decode fills): the copy waits for it.
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            self._count(self.cache.fill_layer(layer, first, self.slot_of, self.keep_from))
            self.ready[layer] = torch.cuda.Event()
            self.ready[layer].record(self.copy_stream)

    def _count(self, from_host: int) -> None:
        self.counts.from_host += from_host
        self.counts.on_device += self.E - from_host

    def experts(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gemm) -> torch.Tensor:
        """Every routed expert of `layer` for all N tokens, from its streamed buffer."""
        if layer == self.sparse_layers[0]:
            self.ready.clear()  # a new forward: nothing of an interrupted one is reused
            self.slot_of = self.cache.slot_map()
        if layer not in self.ready:
            self._start_copy(layer)
        position = self.sparse_layers.index(layer)
        if self.buffers == 2 and position + 1 < len(self.sparse_layers):
            self._start_copy(self.sparse_layers[position + 1])  # overlaps this layer's compute
        event = self.ready.pop(layer)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        first = self._first_slot(layer)
        self.cache.claim_layer(layer, first, self.keep_from)
        last = first + self.E  # the layer's buffer only: its experts are slots 0..E-1 of it
        y = gemm(x, weights, ids.to(torch.int32), self.cache.w13[first:last], self.cache.w2[first:last])
        self.layers_streamed += 1
        return y
