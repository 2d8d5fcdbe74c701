"""The actors that own the expert hierarchy's data-plane mechanisms.

Inside a forward step the GPU runner meets the CPU executor and the PCIe mover once per layer;
a message per layer through the event loop would cost tens of microseconds each, so each of
these actors owns a mechanism the runner's thread calls directly (the CPU executor's doorbell
worker, the mover's copy stream and host pool) and answers only step-level messages: status,
and at shutdown, releasing what it owns.
"""

from __future__ import annotations

from freetoken.actors.messages import Status
from freetoken.actors.runtime import Actor, handles
from freetoken.cache.budget import SlotDecision
from freetoken.cache.host_pool import HostExpertPool
from freetoken.cache.slot_cache import SlotCache


class CpuExecutor(Actor):
    """Owns the CPU expert worker (a Numba kernel behind a thread-level doorbell)."""

    def __init__(self, executor) -> None:
        super().__init__("cpu_executor")
        self.executor = executor

    @handles(Status)
    async def status(self, msg: Status) -> None:
        msg.reply.set({"threads": self.executor.threads})

    async def on_stop(self) -> None:
        self.executor.close()


class PcieMover(Actor):
    """Owns the pinned host pool and the slot fills (copies on their own stream)."""

    def __init__(self, pool: HostExpertPool, slots: SlotCache) -> None:
        super().__init__("pcie_mover")
        self.pool = pool
        self.slots = slots

    @handles(Status)
    async def status(self, msg: Status) -> None:
        fetched = sum(self.slots.stats.fetched)
        msg.reply.set({
            "pool_bytes": self.pool.nbytes,
            "pinned": self.pool.pinned,
            "experts_fetched": fetched,
            "bytes_fetched": fetched * self.pool.expert_bytes,
        })


class MemoryGovernor(Actor):
    """Owns the device memory split between expert slots, the KV cache and headroom."""

    def __init__(self, decision: SlotDecision, slots: SlotCache, kv_bytes: int, dense_bytes: int) -> None:
        super().__init__("memory_governor")
        self.decision = decision
        self.slots = slots
        self.kv_bytes = kv_bytes
        self.dense_bytes = dense_bytes

    @handles(Status)
    async def status(self, msg: Status) -> None:
        stats = self.slots.stats
        msg.reply.set({
            "policy": self.decision.policy,
            "expert_slots": self.decision.slots,
            "slots_reason": self.decision.reason,
            "expert_slot_bytes": self.slots.nbytes,
            "kv_bytes": self.kv_bytes,
            "dense_bytes": self.dense_bytes,
            "hit_rate": stats.hit_rate(),
            "hits": sum(stats.hits),
            "misses": sum(stats.misses),
            "cpu_routes": sum(stats.cpu_routes),
        })
