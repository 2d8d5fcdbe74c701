"""Routing record and replay, hooked between the router and the MoE backend.

Record: every layer's top-k choices go to a JSON-lines routing trace, per request.
Replay: the router's choices are replaced by a trace's (random-weight checkpoints route
almost uniformly, the worst case for any cache; replaying realistic routing measures the
cache as real models would use it). Replayed experts keep the router's own probabilities,
renormalised over the replayed set, so the model still computes a proper weighted mixture.

Shape legend: N tokens, E experts, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from freetoken.config import ModelConfig
from freetoken.trace.routing import RoutingRecorder, RoutingReplay


@dataclass
class StepContext:
    """What the forward pass does not know: whose tokens these are. Set before each forward."""

    requests: list[str] = field(default_factory=list)  # one per sequence row
    phase: str = "decode"
    steps: list[int] = field(default_factory=list)  # each row's step (tokens generated so far)


class RoutingHook:
    def __init__(
        self, config: ModelConfig, recorder: RoutingRecorder | None = None, replay: RoutingReplay | None = None
    ) -> None:
        self.cfg = config
        self.recorder = recorder
        self.replay = replay
        self.context = StepContext()
        # Graph mode: a step's replayed ids for every layer, [L, R, K] int64, drawn on the host
        # into a pinned buffer before the step runs and read onto the device by the step itself
        # (`upload_staged`, a captured step cannot copy from the host mid-way). One pair of
        # buffers per captured batch size R, each graph reading its own.
        self._staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # R -> (pinned host, device)
        self._current: tuple[torch.Tensor, torch.Tensor] | None = None  # the step being staged
        self.use_staged = False  # set by the decode graphs while they run or capture a step

    def stage(self, rows: int, padded_rows: int, device: str) -> None:
        """Draw the next step's replayed ids for every layer (rows tokens) into the pinned buffer
        of its batch size; rows past `rows` (padding up to a captured batch size) repeat row 0,
        as the padded tokens do. The step reads them with `upload_staged`."""
        if self.replay is None:
            return
        L, K = self.cfg.num_layers, self.cfg.top_k
        pair = self._staged.get(padded_rows)
        if pair is None:
            on_cuda = torch.device(device).type == "cuda"
            pair = self._staged[padded_rows] = (
                torch.zeros((L, padded_rows, K), dtype=torch.int64, pin_memory=on_cuda),
                torch.zeros((L, padded_rows, K), dtype=torch.int64, device=device))
        per_layer = []
        for layer in range(L):
            drawn = self.replay.ids_for(layer, rows, K) if self.cfg.sparse_layers[layer] else [[0] * K] * rows
            per_layer.append(drawn + drawn[:1] * (padded_rows - rows))
        pair[0].numpy()[:] = per_layer  # (one conversion of the nested list)
        self._current = pair

    @property
    def staged(self) -> torch.Tensor | None:
        """The device buffer of the step being staged: [L, R, K] int64."""
        return None if self._current is None else self._current[1]

    def upload_staged(self) -> None:
        """Inside the step (captured with it): the staged ids onto the device (on the CPU, the
        kernel's twin)."""
        if self.replay is None:
            return
        from freetoken.kernels.triton.host_read import load_into

        if self._current is None:
            raise RuntimeError("upload_staged before any stage(): the step has no replayed routes drawn")
        load_into(*self._current)

    def __call__(
        self, layer: int, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [N, E], weights/ids [N, K] -> (weights, ids), replaced when replaying."""
        if self.replay is not None:
            if self.use_staged:  # a graph step: drawn before it; eager forwards draw as they go
                ids = self.staged[layer, : ids.shape[0]].to(ids.dtype)  # [N, K]
            else:
                rows = self.replay.ids_for(layer, ids.shape[0], self.cfg.top_k)
                ids = torch.tensor(rows, dtype=ids.dtype, device=ids.device)  # [N, K]
            probs = torch.softmax(logits.float(), dim=-1).gather(1, ids)  # [N, K]
            weights = probs / probs.sum(dim=-1, keepdim=True)
            if not self.cfg.router_weights_fp32:
                weights = weights.to(logits.dtype)
        if self.recorder is not None:
            self._record(layer, weights, ids)
        return weights, ids

    def _record(self, layer: int, weights: torch.Tensor, ids: torch.Tensor) -> None:
        ctx = self.context
        per_row = ids.shape[0] // max(1, len(ctx.requests))
        ids_rows, w_rows = ids.tolist(), weights.float().tolist()
        for i, (request, step) in enumerate(zip(ctx.requests, ctx.steps, strict=True)):
            rows = slice(i * per_row, (i + 1) * per_row)
            self.recorder.record(request, step, layer, ctx.phase, ids_rows[rows], w_rows[rows])

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
