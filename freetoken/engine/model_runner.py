"""The compute side of the engine: dense weights on the device, the expert hierarchy, the KV
cache, one forward per call.

Only this module (and what it drives) touches the device; the GpuRunner actor owns one
ModelRunner and calls it from its worker thread, so the event loop never waits on a kernel.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from freetoken.cache.host_pool import HostExpertPool
from freetoken.cache.live_resize import CacheChange, apply_changes, check_budget
from freetoken.config import EngineConfig, ModelConfig
from freetoken.errors import CheckpointError, RequestError
from freetoken.loader.checkpoint import load_weights
from freetoken.models.kv_cache import KVCache
from freetoken.models.layer_kinds import attention_layers
from freetoken.models.ops import REFERENCE_OPS, fused_ops
from freetoken.models.recurrent_state import RecurrentStatePool
from freetoken.models.transformer import MoETransformer
from freetoken.models.weights import LinearAttentionWeights, ModelWeights
from freetoken.moe.factory import build_expert_hierarchy
from freetoken.trace import NULL_RECORDER, TraceRecorder

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadReport:
    seconds: float
    weight_bytes: int  # dense weights on the device
    pool_bytes: int  # the host expert pool
    slot_bytes: int  # the device expert cache
    kv_bytes: int
    policy: str
    slots: int
    pool_experts: int
    ratio: float | None  # the hybrid split's PCIe share
    ratio_source: str
    state_bytes: int = 0  # the recurrent-state pool of linear-attention layers
    profile_bps: tuple[float, float] | None = None  # (PCIe fill, CPU expert) bytes/s the split came from
    host_weight_bytes: int = 0  # dense weights kept in host memory (the token embedding table on CUDA)

    def summary(self) -> str:
        split = f", r={self.ratio:.3f} ({self.ratio_source})" if self.ratio is not None else ""
        state = f", recurrent state {self.state_bytes / 1e9:.2f} GB" if self.state_bytes else ""
        host = f" (+ {self.host_weight_bytes / 1e9:.2f} GB of embeddings on host)" if self.host_weight_bytes else ""
        return (
            f"dense {self.weight_bytes / 1e9:.2f} GB{host}, KV {self.kv_bytes / 1e9:.2f} GB{state}, experts: pool "
            f"{self.pool_bytes / 1e9:.2f} GB on host, {self.slots}/{self.pool_experts} slots "
            f"({self.slot_bytes / 1e9:.2f} GB), policy {self.policy}{split}; {self.seconds:.1f} s"
        )


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        config: EngineConfig,
        rows: int,
        recorder: TraceRecorder = NULL_RECORDER,
        pool: HostExpertPool | None = None,
    ) -> None:
        """`pool`: an already loaded host expert pool to share (benchmarks compare policies
        on one pool); by default the runner loads and owns its own."""
        started = time.perf_counter()
        self.device = config.resolved_device()
        if self.device == "cuda" and not torch.cuda.is_available():
            raise CheckpointError("device 'cuda' was asked for, but torch sees no CUDA device")
        self.dtype = DTYPES[config.resolved_dtype()]
        if self.device == "cuda":
            # cuDNN attention builds a new plan for every key length it meets (measured: ~14 ms
            # per layer at each new length): decode meets a new length every step.
            torch.backends.cuda.enable_cudnn_sdp(False)
            from freetoken.kernels.triton import pdl

            pdl.set_enabled(config.kernels.pdl)  # before any kernel is launched or captured
        cfg, host_weights = load_weights(model_dir, self.dtype, experts=False)
        self.model_config: ModelConfig = cfg
        self.weights = _to_device(host_weights, self.device)
        self.fused = config.kernels.dense == "fused" and self.device == "cuda"
        if self.fused and self.dtype in FUSED_DTYPES:  # before the free memory is measured for the caches
            for layer in self.weights.layers:
                if isinstance(layer.attn, LinearAttentionWeights):
                    layer.attn.fuse_in_proj()
                else:  # (the fused decode kernels read q/k/v as one projection)
                    layer.attn.fuse_qkv()
        self.max_len = min(config.max_model_len, cfg.max_position_embeddings)
        # Default KV pool: a full-length sequence for each of `rows` concurrent ones.
        z = config.kv.page_size
        kv_tokens = config.kv.tokens or rows * self.max_len
        self.cache = KVCache(  # (the layers with KV pages: all but linear-attention ones)
            len(attention_layers(cfg)), -(-kv_tokens // z), z, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device
        )
        # Linear-attention layers: a recurrent-state slot per running sequence (a shared prefix
        # resumes from a state saved at an anchor: cache/state_anchors.py).
        self.states = RecurrentStatePool.for_model(cfg, rows, self.dtype, self.device) if cfg.linear_attention else None
        self.max_len = min(self.max_len, self.cache.tokens)
        self.rows = rows
        self.owns_pool = pool is None
        self.pool = HostExpertPool.load(model_dir, cfg, self.dtype) if pool is None else pool
        self.pool.pin()
        slot_bytes = self.pool.format.slot_bytes(cfg, self.dtype)
        moe = build_expert_hierarchy(config, self.pool, device=self.device, dtype=self.dtype, slot_bytes=slot_bytes,
                                     recorder=recorder)
        self.slots, self.executor, self.live_split = moe.slots, moe.executor, moe.live_split
        self.live_choice, self.live_threads = moe.live_choice, moe.live_threads
        if self.live_choice is not None:  # (its per-step hit rate reads the counters graph mode keeps on the device)
            self.live_choice.sync_stats = self.sync_stats
        # what each decode step tells at its start and end: auto's live choice (which folds the
        # split too), else the live split, else nothing
        self._live = self.live_choice or self.live_split
        self.headroom_bytes = int(config.moe.gpu_memory_headroom_gb * 2**30)
        backend, gemm = moe.backend, moe.gemm
        ops = fused_ops() if self.fused and self.dtype in FUSED_DTYPES else REFERENCE_OPS
        self.dense_kernels = "reference" if ops is REFERENCE_OPS else "fused"
        self.model = MoETransformer(cfg, self.weights, backend, self.device, ops)
        self.routing = None
        if config.trace.record_routing or config.trace.routing_replay:
            from freetoken.engine.routing_hook import RoutingHook
            from freetoken.trace.routing import RoutingRecorder, RoutingReplay

            self.routing = RoutingHook(
                cfg,
                recorder=RoutingRecorder(config.trace.record_routing) if config.trace.record_routing else None,
                replay=RoutingReplay(config.trace.routing_replay, cfg.num_layers, cfg.num_experts)
                if config.trace.routing_replay
                else None,
            )
            self.model.routing_hook = self.routing
        self.graphs = None
        if self.device == "cuda" and not config.graphs.eager:
            if not self.fused:
                log.warning("dense_kernels 'reference' runs exact shapes: decode runs eager")
            elif config.trace.record_routing:
                log.warning("--record-routing reads every layer's routes on the host: decode runs eager")
            elif gemm != "triton":
                log.warning("the torch expert loop reads routes on the host: decode runs eager")
            else:
                from freetoken.engine.decode_graphs import DecodeGraphs, batch_sizes_for

                sizes = list(config.graphs.batch_sizes or batch_sizes_for(rows))
                if max(sizes) < rows or min(sizes) < 1:
                    raise CheckpointError(f"graph batch sizes {sizes} must be >= 1 and cover {rows} running requests")
                self.graphs = DecodeGraphs(self, sizes, config.graphs.watchdog_s, recorder)
        self.report = LoadReport(
            seconds=time.perf_counter() - started,
            weight_bytes=sum(t.nbytes for t in self.weights.tensors() if t.device.type == self.device),
            host_weight_bytes=sum(t.nbytes for t in self.weights.tensors() if t.device.type != self.device),
            pool_bytes=self.pool.nbytes,
            slot_bytes=self.slots.nbytes,
            kv_bytes=self.cache.nbytes,
            policy=moe.policy.name if moe.live_choice is None else "auto (transfer, hybrid or cpu, chosen live)",
            slots=moe.slots.num_slots,
            pool_experts=cfg.num_sparse_layers * cfg.num_experts,
            ratio=moe.ratio,
            ratio_source=moe.ratio_source,
            state_bytes=0 if self.states is None else self.states.nbytes,
            profile_bps=moe.profile_bps,
        )

    def sync_stats(self) -> None:
        """Bring the expert cache counters up to date (graph mode keeps them on the device)."""
        if self.graphs is not None:
            self.graphs.sync_stats()

    # -- live resize (the caller guarantees no step is in flight) ---------------------------------
    def status(self) -> dict:
        self.sync_stats()
        stats = self.slots.stats
        fetched = sum(stats.fetched)
        return {
            "policy": self.slots.policy.name,
            "policy_params": self.slots.policy.params(),
            "expert_slots": self.slots.num_slots,
            "pool_experts": self.report.pool_experts,
            "expert_slot_bytes": self.slots.nbytes,
            "expert_pool_bytes": self.pool.nbytes,
            "kv_tokens": self.cache.tokens,
            "kv_pages": self.cache.num_pages,
            "kv_page_size": self.cache.page_size,
            "max_model_len": self.max_len,
            "kv_bytes": self.cache.nbytes,
            "recurrent_state_bytes": 0 if self.states is None else self.states.nbytes,
            "dense_bytes": self.report.weight_bytes,
            "dense_host_bytes": self.report.host_weight_bytes,  # (the token embedding table, on CUDA)
            "device_free_bytes": torch.cuda.mem_get_info()[0] if self.device == "cuda" else None,
            "hit_rate": stats.hit_rate(),
            "hits": sum(stats.hits),
            "misses": sum(stats.misses),
            "experts_fetched": fetched,
            "bytes_fetched": fetched * self.pool.expert_bytes,
            "experts_filled_in_background": sum(stats.background),
            # Prefill streaming's experts: over PCIe (from_host), and copied on the GPU from the decode cache.
            "prefill_experts_streamed": vars(self.model.backend.stream_counts).copy(),
            "prefill_bytes_streamed": self.model.backend.stream_counts.from_host * self.pool.expert_bytes,
            "cpu_routes": sum(stats.cpu_routes),
            # Per MoE layer since start, for the dashboard's per-layer hit rates over recent steps.
            "layers": {name: list(getattr(stats, name)) for name in ("hits", "misses", "fetched", "cpu_routes")},
            # Hybrid's PCIe share r and where it came from (the bandwidth profile, a parameter, ...).
            "split_ratio": self.report.ratio if self._live is None else self._live.ratio,
            "split_ratio_source": self.report.ratio_source,
            # With a live split: its estimates, target and recent ratios (moe/live_split.py).
            "live_split": None if self.live_split is None else self.live_split.status(),
            # auto: the mode it runs (transfer, hybrid, cpu), its probes and choices (moe/live_policy.py).
            "live_policy": None if self.live_choice is None else self.live_choice.status(),
            # With a live split: the CPU executor's thread count following it (moe/live_threads.py).
            "live_cpu_threads": None if self.live_threads is None else self.live_threads.status(),
            # What the engine's own timings say of both links (cache/live_bandwidth.py), beside
            # the profile's figures the split came from (None: r is a parameter, or unused).
            "live_bandwidth": self.model.backend.live_status(),
            "profile_bandwidth": None if self.report.profile_bps is None else dict(
                zip(("pcie_fill_bytes_per_s", "cpu_expert_bytes_per_s"), self.report.profile_bps, strict=True)),
            # The poller answering captured steps' CPU branch; None without a CPU executor.
            "cpu_poller": None if self.executor is None else self.executor.poller,
            # Which dense ops run: "fused" (kernels/triton/, CUDA) or "reference"; whether one-token
            # steps take the fused decode attention.
            "dense_kernels": self.dense_kernels,
            "fused_decode_attention": self.model.fused_decode,
            "decode_graphs": None if self.graphs is None else {
                "cpu_doorbell": self.graphs.mechanism,
                "background_filler": self.graphs.background_filler(),
                "batch_sizes": self.graphs.batch_sizes,
                "captured": [list(shape) for shape in sorted(self.graphs.graphs)],  # [batch, key bucket]
                "eager_shapes": [list(shape) for shape in sorted(self.graphs.uncapturable)],
                "capture_failures": self.graphs.capture_failures,
            },
        }

    def resize(self, moe_slots: int | None, kv_pages: int | None, page_map: dict[int, int] | None = None) -> None:
        """Resize the expert slots and/or the KV page pool in place (`page_map`: the pages kept,
        old id -> new id, from the Scheduler). Sizes are checked before anything changes: an
        impossible size raises RequestError and leaves both caches as they were; a device that
        refuses memory part-way raises ResizeRolledBack, the caches restored (cache/live_resize.py)."""
        page_map = page_map or {}
        if kv_pages is not None and kv_pages * self.cache.page_size < self.max_len:
            raise RequestError(
                f"the KV cache must hold at least one full-length sequence ({self.max_len} tokens, "
                f"{-(-self.max_len // self.cache.page_size)} pages); {kv_pages} pages asked for", param="kv_tokens")
        if kv_pages is not None and kv_pages < len(page_map):
            raise RequestError(f"{kv_pages} KV pages cannot hold the {len(page_map)} pages running sequences use",
                               param="kv_tokens")
        if moe_slots is not None:
            pool_experts = self.report.pool_experts
            if not 1 <= moe_slots <= pool_experts:
                raise RequestError(f"moe_slots must be in [1, {pool_experts}], got {moe_slots}", param="moe_slots")
            if self.slots.policy.every_expert and moe_slots != pool_experts:
                raise RequestError(f"policy {self.slots.policy.name!r} keeps every expert on the device; start with "
                                   "another --moe-policy to resize the expert cache", param="moe_slots")
        changes = []
        if self._live is not None:
            self._live.interrupt()
        if moe_slots is not None and moe_slots != self.slots.num_slots:
            slots, old_slots = self.slots, self.slots.num_slots
            changes.append(CacheChange("moe_slots", f"{moe_slots} expert slots",
                                       slots.committed_bytes(moe_slots) - slots.committed_bytes(old_slots),
                                       lambda: slots.resize(moe_slots), lambda: slots.resize(old_slots)))
        if kv_pages is not None:
            cache, old_pages = self.cache, self.cache.num_pages
            back = {new: old for old, new in page_map.items() if old != new}
            changes.append(CacheChange("kv_tokens", f"{kv_pages * cache.page_size} KV tokens",
                                       cache.committed_bytes(kv_pages) - cache.committed_bytes(old_pages),
                                       lambda: cache.resize(kv_pages, page_map),
                                       lambda: cache.resize(old_pages, back)))
        if self.device == "cuda":  # (blocks torch holds unused are given back before the caches grow)
            free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        else:  # host memory the system has not handed out yet
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        check_budget(changes, free - self.headroom_bytes)
        if kv_pages is not None and kv_pages > self.cache.max_pages:  # (past the memory the pool reserved room for)
            raise RequestError(f"{kv_pages} KV pages exceed the {self.cache.max_pages} this device's memory "
                               "could ever hold", param="kv_tokens")
        if self.graphs is not None:  # captured graphs read the slot count and the pool's size
            self.settle_fills()
            self.graphs.invalidate()
        if self.device == "cuda":
            torch.cuda.empty_cache()  # what the dropped graphs held: the caches' own commits bypass torch
        try:
            apply_changes(changes)
        finally:
            if moe_slots is not None:  # a new slot count gets its own prefill streamer
                self.model.backend.cache = self.slots
            self.report.slots, self.report.slot_bytes = self.slots.num_slots, self.slots.nbytes
            self.report.kv_bytes = self.cache.nbytes
            if self.device == "cuda":
                torch.cuda.empty_cache()  # (the KV moves' temporary)

    def settle_fills(self) -> None:
        """Background fills still landing from the last captured step are done (before other work
        on the slots: prefill, a resize, shutdown)."""
        if self.graphs is not None:
            self.graphs.settle_fills()

    def close(self) -> None:
        try:
            self.settle_fills()
        finally:  # (a fill the driver refused raises, after the cache was emptied)
            if self.executor is not None:
                self.executor.close()
            if self.routing is not None:
                self.routing.close()
            if self.owns_pool:
                self.pool.unpin()

    def set_context(self, requests: list[str], phase: str, steps: list[int]) -> None:
        """Who the next forward's rows belong to (for routing traces)."""
        if self.routing is not None:
            ctx = self.routing.context
            ctx.requests, ctx.phase, ctx.steps = requests, phase, steps

    def row_pages(self, row: int) -> list[int]:
        """Fixed pages for sequence `row` of `rows`, when no Scheduler hands pages out (tests,
        benchmarks): row r owns a contiguous run of the pool."""
        per_row = self.cache.num_pages // self.rows
        return list(range(row * per_row, (row + 1) * per_row))

    def row_state_slot(self, row: int) -> int | None:
        """Sequence `row`'s recurrent-state slot beside `row_pages` (None: the model has none);
        a prefill from position 0 starts it afresh."""
        if self.states is None:
            return None
        if not 0 <= row < self.states.num_slots:
            raise ValueError(f"row {row} is outside the {self.states.num_slots} recurrent-state slots")
        return row

    def _with_states(self, kv, state_slots: list[int] | None):
        """kv, with each row's recurrent-state slot where the model has linear-attention layers."""
        if self.states is None:
            return kv
        if state_slots is None:
            raise ValueError(f"{self.model_config.arch} has linear-attention layers: a step needs each "
                             "sequence's recurrent-state slot (RecurrentStatePool.acquire)")
        return kv.attach_states(self.states, state_slots)

    def prefill(self, pages: list[int], token_ids: list[int], start: int = 0,
                state_slot: int | None = None) -> torch.Tensor:
        """Run a sequence's tokens at positions start..start+T-1 into its pages -> last logits [1, V].
        state_slot: its recurrent-state slot (models with linear-attention layers), holding the
        state after position start-1 (a fresh, zeroed slot at start 0)."""
        self.settle_fills()
        if self._live is not None:
            self._live.interrupt()
        if start == 0 and state_slot is not None:  # nothing comes before position 0
            self.states.reset(state_slot)
        tokens = torch.tensor([token_ids], device=self.device)  # [1, T]
        positions = list(range(start, start + len(token_ids)))
        key_len = start + len(token_ids)
        kv = self._with_states(self.cache.view([pages], [positions], key_len),
                               None if state_slot is None else [state_slot])
        return self.model.forward(tokens, torch.tensor([positions], device=self.device), kv, key_len)

    def decode(self, page_tables: list[list[int]], tokens: list[int], positions: list[int],
               state_slots: list[int] | None = None) -> torch.Tensor:
        """One new token for each of B sequences -> logits [B, V] (state_slots: as `prefill`'s, one per sequence)."""
        if self._live is None:
            return self._decode(page_tables, tokens, positions, state_slots)
        self._live.begin_step(len(tokens))
        logits = self._decode(page_tables, tokens, positions, state_slots)
        self._live.end_step()
        return logits

    def _decode(self, page_tables: list[list[int]], tokens: list[int], positions: list[int],
                state_slots: list[int] | None) -> torch.Tensor:
        if self.graphs is not None:
            return self.graphs.decode(page_tables, tokens, positions, state_slots)
        t = torch.tensor(tokens, device=self.device)[:, None]  # [B, 1]
        p = torch.tensor(positions, device=self.device)[:, None]  # [B, 1]
        key_len = max(positions) + 1
        padded = self.fused  # the graphs' key buckets, so eager and captured steps agree
        if padded:
            from freetoken.engine.decode_graphs import key_bucket

            key_len = key_bucket(key_len)
        kv = self._with_states(self.cache.view(page_tables, [[q] for q in positions], key_len, padded=padded),
                               state_slots)
        return self.model.forward(t, p, kv, key_len)


FUSED_DTYPES = (torch.bfloat16, torch.float32)


def _to_device(weights: ModelWeights, device: str) -> ModelWeights:
    """The dense weights onto the device, but an untied token embedding table: a step reads only
    its tokens' rows, so the table stays in pinned host memory and the device gathers them over the
    bus (models/transformer.embed), leaving its V x H bytes to the expert cache and the KV pool."""
    if device == "cpu":
        return weights
    untied = weights.lm_head is not weights.embed
    moved = {id(t): t.contiguous().pin_memory() if untied and t is weights.embed else t.to(device)
             for t in weights.tensors()}

    def swap(obj):
        for name, value in vars(obj).items():
            if isinstance(value, torch.Tensor):
                setattr(obj, name, moved[id(value)])
            elif value is not None and hasattr(value, "__dict__"):
                swap(value)

    for layer in weights.layers:
        swap(layer)
    weights.embed, weights.final_norm, weights.lm_head = (
        moved[id(weights.embed)],
        moved[id(weights.final_norm)],
        moved[id(weights.lm_head)],
    )
    return weights
