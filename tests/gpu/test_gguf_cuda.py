"""A quantized GGUF (Q4_K_M: Q4_K and Q6_K layers) served from its blocks on CUDA: the Triton block
GEMM over slots, the device dequantizer in prefill, the decode graphs and the CPU block kernel, in
fp32 against transformers' GGUF loader (fp32, on the CPU), under every placement."""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig, MoeConfig, SchedulerConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.loader.synth_gguf import write_synthetic_gguf

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS = 24
PLACEMENTS = [("resident", None), ("transfer", 3), ("static", 6), ("cpu", 2), ("hybrid", 5), ("hybrid", 12)]


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "tiny-Q4_K_M.gguf"
    return write_synthetic_gguf(out, "qwen3_moe", "tiny-gguf", file_type="Q4_K_M", layers=8, experts=4, seed=5)


@pytest.fixture(scope="module")
def reference_tokens(q4_k_m):
    model = transformers.AutoModelForCausalLM.from_pretrained(q4_k_m.parent, gguf_file=q4_k_m.name,
                                                              dtype=torch.float32).eval()
    ids = torch.randint(0, 1024, (1, 80), generator=torch.Generator().manual_seed(7))  # long enough to stream
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("policy,slots", PLACEMENTS)
def test_q4_k_m_greedy_on_cuda_matches_transformers(q4_k_m, reference_tokens, policy, slots):
    prompt, theirs = reference_tokens
    config = EngineConfig(model=str(q4_k_m), device="cuda", dtype="float32", max_model_len=128,
                          moe=MoeConfig(policy=policy, cache_slots=slots), scheduler=SchedulerConfig(prefill_chunk=64))
    runner = ModelRunner(str(q4_k_m), config, rows=1)
    try:
        ours = [int(runner.prefill(runner.row_pages(0), prompt).argmax())]
        while len(ours) < STEPS:
            ours.append(int(runner.decode([runner.row_pages(0)], [ours[-1]], [len(prompt) + len(ours) - 1]).argmax()))
    finally:
        runner.close()
    assert ours == theirs, f"{policy} with {slots} slots"
