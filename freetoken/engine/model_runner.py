"""The compute side of the engine: weights on the device, the KV cache, one forward per call.

Only this module (and the models it drives) touches the device; the GpuRunner actor owns one
ModelRunner and calls it from its worker thread, so the event loop never waits on a kernel.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from freetoken.config import EngineConfig, ModelConfig
from freetoken.errors import CheckpointError
from freetoken.loader.checkpoint import load_weights
from freetoken.models.kv_cache import KVCache
from freetoken.models.transformer import MoETransformer, ResidentExperts
from freetoken.models.weights import ModelWeights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadReport:
    seconds: float
    weight_bytes: int
    kv_bytes: int


class ModelRunner:
    def __init__(self, model_dir: str, config: EngineConfig, rows: int) -> None:
        started = time.perf_counter()
        self.device = config.resolved_device()
        if self.device == "cuda" and not torch.cuda.is_available():
            raise CheckpointError("device 'cuda' was asked for, but torch sees no CUDA device")
        self.dtype = DTYPES[config.resolved_dtype()]
        cfg, host_weights = load_weights(model_dir, self.dtype)
        self.model_config: ModelConfig = cfg
        self.weights = _to_device(host_weights, self.device)
        self.max_len = min(config.max_model_len, cfg.max_position_embeddings)
        self.cache = KVCache(cfg.num_layers, rows, self.max_len, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        self.model = MoETransformer(cfg, self.weights, ResidentExperts(self.weights), self.device)
        self.report = LoadReport(
            seconds=time.perf_counter() - started,
            weight_bytes=sum(t.nbytes for t in self.weights.tensors()),
            kv_bytes=self.cache.nbytes,
        )

    def prefill(self, row: int, token_ids: list[int], start: int = 0) -> torch.Tensor:
        """Run a sequence's prompt (positions start..start+T-1) into its KV row -> last logits [1, V]."""
        tokens = torch.tensor([token_ids], device=self.device)  # [1, T]
        positions = torch.arange(start, start + len(token_ids), device=self.device)[None]  # [1, T]
        rows = torch.tensor([row], device=self.device)
        return self.model.forward(tokens, positions, self.cache, rows)

    def decode(self, rows: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One new token for each of B sequences -> logits [B, V]."""
        t = torch.tensor(tokens, device=self.device)[:, None]  # [B, 1]
        p = torch.tensor(positions, device=self.device)[:, None]  # [B, 1]
        return self.model.forward(t, p, self.cache, torch.tensor(rows, device=self.device))


def _to_device(weights: ModelWeights, device: str) -> ModelWeights:
    if device == "cpu":
        return weights
    moved = {id(t): t.to(device) for t in weights.tensors()}

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
