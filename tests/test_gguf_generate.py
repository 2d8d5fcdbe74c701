"""A bf16 GGUF file of a checkpoint generates the checkpoint's greedy tokens."""

from __future__ import annotations

from freetoken.config import EngineConfig, ModelConfig
from freetoken.engine.llm import model_name, open_checkpoint
from freetoken.engine.model_runner import ModelRunner
from tests.gguf_testfiles import write_gguf

PROMPT = [1, 2, 3, 4, 5, 300, 17]


def _greedy(path, n: int) -> list[int]:
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", max_model_len=64, max_running_requests=1)
    open_checkpoint(path, config)  # config, context and tokenizer checks, as the engine starts
    runner = ModelRunner(str(path), config, rows=1)
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
