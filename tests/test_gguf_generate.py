"""A bf16 GGUF file of a checkpoint generates the checkpoint's greedy tokens.

The host expert pool is filled here through `open_tensor_reader`, as `HostExpertPool.load` does
for a directory (the pool opens GGUF files once it asks for that reader).
"""

from __future__ import annotations

from contextlib import ExitStack

import torch

from freetoken.cache.host_pool import HostExpertPool
from freetoken.config import EngineConfig, ModelConfig
from freetoken.engine.llm import model_name, open_checkpoint
from freetoken.engine.model_runner import ModelRunner
from freetoken.loader.checkpoint import open_tensor_reader
from freetoken.moe.expert_format import format_for
from tests.gguf_testfiles import write_gguf

PROMPT = [1, 2, 3, 4, 5, 300, 17]


def _pool(path, cfg: ModelConfig) -> HostExpertPool:
    L, E = cfg.num_layers, cfg.num_experts
    with ExitStack() as stack:
        reader = open_tensor_reader(path, stack)
        fmt = format_for(reader, torch.float32)
        w13, w2 = (torch.zeros(L * E, *bank.row_shape, dtype=bank.dtype) for bank in fmt.banks(cfg))
        for layer in range(L):
            rows = slice(layer * E, (layer + 1) * E)
            fmt.read_layer(reader, cfg, layer, out=(w13[rows], w2[rows]))
    return HostExpertPool(cfg, w13, w2, fmt)


def _greedy(path, n: int) -> list[int]:
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", max_model_len=64, max_running_requests=1)
    open_checkpoint(path, config)  # config, context and tokenizer checks, as the engine starts
    runner = ModelRunner(str(path), config, rows=1, pool=_pool(path, ModelConfig.from_checkpoint(path)))
    try:
        out = [int(runner.prefill(runner.row_pages(0), PROMPT).argmax())]
        while len(out) < n:
            out.append(int(runner.decode([runner.row_pages(0)], [out[-1]], [len(PROMPT) + len(out) - 1]).argmax()))
        return out
    finally:
        runner.close()


def test_bf16_gguf_generates_the_checkpoints_greedy_tokens(make_checkpoint, tmp_path):
    source = make_checkpoint("qwen3_moe", "tiny")
    path = write_gguf(source, tmp_path / "tiny-bf16.gguf")
    assert model_name(path) == "tiny-bf16"
    # norm_topk_prob: the GGUF runs as llama.cpp does, renormalised; the source must as well
    assert ModelConfig.from_dir(source).norm_topk_prob
    assert _greedy(path, 8) == _greedy(source, 8)
