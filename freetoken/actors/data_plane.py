"""The actors that own the expert hierarchy's data-plane mechanisms.

Inside a forward step the GPU runner meets the CPU executor and the PCIe mover once per layer;
a message per layer through the event loop would cost tens of microseconds each, so each of
these actors owns a mechanism the runner's thread calls directly (the CPU executor's doorbell
worker, the mover's copy stream and host pool) and answers only step-level messages: status,
and at shutdown, releasing what it owns.
"""

from __future__ import annotations

from freetoken.actors.messages import ResizeCaches, Status
from freetoken.actors.runtime import Actor, handles
from freetoken.cache.host_pool import HostExpertPool


class CpuExecutor(Actor):
    """Owns the CPU expert worker (a Numba kernel behind a thread-level doorbell). The worker
    outlives this actor at shutdown: a step still running in the GPU runner's thread may need
    it; the model runner closes it after the last step."""

    def __init__(self, executor) -> None:
        super().__init__("cpu_executor")
        self.executor = executor

    @handles(Status)
    async def report_status(self, msg: Status) -> None:
        msg.reply.set({"threads": self.executor.threads})



class PcieMover(Actor):
    """Owns the pinned host pool and the slot fills (copies on their own stream)."""

    def __init__(self, runner) -> None:
        super().__init__("pcie_mover")
        self.runner = runner  # its slot cache is replaced by a resize: always read it from there
        self.pool: HostExpertPool = runner.pool

    @handles(Status)
    async def report_status(self, msg: Status) -> None:
        fetched = sum(self.runner.slots.stats.fetched)
        msg.reply.set({
            "pool_bytes": self.pool.nbytes,
            "pinned": self.pool.pinned,
            "experts_fetched": fetched,
            "bytes_fetched": fetched * self.pool.expert_bytes,
        })


class MemoryGovernor(Actor):
    """Owns the device memory split between expert slots, the KV cache and headroom: reports
    it, and resizes it through the Scheduler, which applies a resize between two steps."""

    def __init__(self, runner, scheduler: Actor) -> None:
        super().__init__("memory_governor")
        self.runner = runner  # ModelRunner: its status() is read between steps or as a snapshot
        self.scheduler = scheduler

    @handles(Status)
    async def report_status(self, msg: Status) -> None:
        msg.reply.set(self.runner.status())

    @handles(ResizeCaches)
    async def apply_resize(self, msg: ResizeCaches) -> None:
        try:
            status = await self.scheduler.ask(
                lambda r: ResizeCaches(moe_slots=msg.moe_slots, kv_tokens=msg.kv_tokens, reply=r)
            )
        except Exception as exc:  # the caller gets the reason; the old caches are intact
            msg.reply.fail(exc)
            return
        msg.reply.set(status)
