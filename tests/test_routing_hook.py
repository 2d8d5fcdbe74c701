"""The routing hook between router and MoE backend: replay staged for decode graphs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from freetoken.engine.routing_hook import RoutingHook
from freetoken.trace.routing import RoutingReplay
from tests.test_routing_trace import _trace


def test_staged_replay_serves_graph_steps_only(tmp_path: Path) -> None:
    """Graph steps read ids staged before them; eager forwards (prefill) draw as they go."""
    trace = _trace(tmp_path, 2, 16, 4, 10)
    by_layer = trace.tokens_by_layer()
    # the fields of ModelConfig the hook reads
    cfg = SimpleNamespace(num_layers=2, top_k=4, sparse_layers=(True, True), router_weights_fp32=True)
    hook = RoutingHook(cfg, replay=RoutingReplay(trace, 2, 16))
    logits = torch.zeros(3, 16)
    hook.stage(2, 3, "cpu")  # two real rows, padded to three by repeating row 0
    hook.upload_staged()  # (what the step does first)
    assert hook.staged[1].tolist() == by_layer[1][:2] + by_layer[1][:1]
    hook.use_staged = True
    _, ids = hook(1, logits, torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.int64))
    assert ids.tolist() == by_layer[1][:2] + by_layer[1][:1]
    hook.use_staged = False  # a prefill after decode steps draws the next rows itself
    _, ids = hook(1, logits, torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.int64))
    assert ids.tolist() == by_layer[1][2:5]


def test_each_batch_size_keeps_its_staged_buffer(tmp_path: Path) -> None:
    """A graph captured at one batch size reads that size's device buffer whatever sizes ran in
    between: staging another size must not replace it."""
    trace = _trace(tmp_path, 2, 16, 4, 10)
    by_layer = trace.tokens_by_layer()
    cfg = SimpleNamespace(num_layers=2, top_k=4, sparse_layers=(True, False), router_weights_fp32=True)
    hook = RoutingHook(cfg, replay=RoutingReplay(trace, 2, 16))
    hook.stage(1, 1, "cpu")
    one = hook.staged
    hook.upload_staged()
    hook.stage(2, 4, "cpu")
    hook.upload_staged()
    assert hook.staged is not one and hook.staged.shape == (2, 4, 4)
    assert hook.staged[0].tolist() == by_layer[0][1:3] + by_layer[0][1:2] * 2
    assert hook.staged[1].tolist() == [[0] * 4] * 4  # a dense layer routes nothing
    hook.stage(1, 1, "cpu")
    hook.upload_staged()
    assert hook.staged is one and one[0].tolist() == by_layer[0][3:4]
