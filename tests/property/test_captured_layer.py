"""The MoE layer a decode graph captures, run on the CPU: it must compute what the eager layer
computes, bit for bit, and count the same hits, misses, fetches and CPU routes.

The captured layer plans on the device, hands CPU routes to the executor's compiled poller
through the mailbox, fills slots with the copy-plan kernel and adds the CPU's sum with the
hand-off kernel. Without a GPU the kernels run in Triton's interpreter, and the stream's flag
writes and waits are played by `HostFlags` (a write stores the word; a wait spins on it), so
everything but the graph capture itself runs in CI.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from freetoken.cache.host_pool import HostExpertPool
from freetoken.cache.offloaded_moe import OffloadedExperts
from freetoken.cache.slot_cache import CacheStats, SlotCache
from freetoken.config import ModelConfig
from freetoken.engine.graph_plane import GraphPlane
from freetoken.kernels.cpu.executor import CpuExpertExecutor
from freetoken.kernels.cpu.mailbox import Mailbox
from freetoken.moe.policy import sim_policy
from freetoken.moe.slot_gemm import triton_slots_gemm
from freetoken.reference.expert_cache import share_q16


class HostFlags:
    """Stream flags for a device that runs every operation when it is issued."""

    kind = "host"

    def __init__(self, mailbox: Mailbox) -> None:
        self.mailbox = mailbox

    def _word(self, addr: int) -> int:
        return (addr - self.mailbox.flags_t.data_ptr()) // 4

    def write(self, addr: int, value: int) -> None:
        self.mailbox.flags[self._word(addr)] = value

    def wait_geq(self, addr: int, value: int) -> None:
        word, deadline = self._word(addr), time.monotonic() + 60
        while int(self.mailbox.flags[word]) - value < 0:
            if time.monotonic() > deadline:
                raise TimeoutError("the poller never answered")  # fails the test instead of hanging


def _bits(bank: torch.Tensor) -> np.ndarray:
    return bank.view(torch.int16).numpy().view("uint16")


@pytest.mark.parametrize("policy,slots", [("hybrid", 10), ("cpu", 4), ("transfer", 6), ("static", 8)])
def test_captured_layer_equals_the_eager_layer(policy, slots, make_checkpoint):
    model_dir = make_checkpoint("qwen3_moe", "tiny", seed=7)
    cfg = ModelConfig.from_dir(model_dir)
    pool = HostExpertPool.load(model_dir, cfg)
    ratio = share_q16(0.5)
    rule = sim_policy(policy, background_fills=False)  # every fill waited for: the layer's output is the eager one's
    caches = [SlotCache(pool, slots, rule, ratio, "cpu", torch.bfloat16, planner="triton") for _ in range(2)]
    # one executor each: a captured step's poller holds its worker until the step's last ring
    executors = [CpuExpertExecutor(_bits(pool.w13), _bits(pool.w2), threads=1) for _ in range(2)]
    eager = OffloadedExperts(caches[0], executors[0], [triton_slots_gemm] * cfg.num_layers, stream_min_tokens=None)
    captured = OffloadedExperts(caches[1], executors[1], [triton_slots_gemm] * cfg.num_layers, stream_min_tokens=None)
    rows, steps = 3, 6
    mailbox = Mailbox(rows, cfg.top_k, cfg.hidden_size, pinned=False)
    plane = GraphPlane(cfg.num_layers, "cpu", mailbox, HostFlags(mailbox))
    captured.graph_plane = plane
    g = torch.Generator().manual_seed(0)
    ticket = None
    try:
        for step in range(steps):  # each step: armed, served through its last layer's ring
            if policy != "transfer":
                mailbox.arm()
                ticket = executors[1].serve(mailbox, cfg.num_layers, cfg.num_layers)
            n = 1 + step % rows
            if policy == "hybrid" and step >= 2:  # a live split: the next plans follow it (the eager
                for cache in caches:  # one through its host int, the captured one through its device word)
                    cache.set_ratio_q16((0, 65536, 9000, share_q16(0.8))[step - 2])
            for layer in range(cfg.num_layers):
                x = torch.randn(n, cfg.hidden_size, generator=g).to(torch.bfloat16)
                weights = torch.rand(n, cfg.top_k, generator=g).to(torch.bfloat16)
                ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[: cfg.top_k] for _ in range(n)])
                want = eager.experts(layer, x, weights, ids)
                got = captured.experts(layer, x, weights, ids)
                assert torch.equal(got, want), (step, layer)
            if ticket is not None:
                mailbox.finish(ticket, drained=lambda: True, timeout=60)
    finally:
        if ticket is not None and not ticket.done():
            mailbox.cancel(ticket, timeout=10)
        for executor in executors:
            executor.close()
    host = CacheStats.zeros(cfg.num_layers)
    plane.fold_into(host)
    assert host == caches[0].stats
    if policy in ("hybrid", "cpu"):
        assert sum(host.cpu_routes) > 0  # the doorbell carried work
    assert caches[1].reference_state() == caches[0].reference_state()
