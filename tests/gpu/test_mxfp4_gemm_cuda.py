"""gpt-oss's MXFP4 experts served on CUDA by the Triton slot GEMM (kernels/triton/mxfp4_moe_gemm.py):
`--moe-gemm triton` (decode graphs, the blocks decoded in the kernel) gives the greedy tokens of
`--moe-gemm torch` (eager, each routed slot dequantized, then the loop), with every expert
resident and with a cache of a layer's experts filled as decode goes."""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig, KernelConfig, MoeConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.loader.synth import write_synthetic_checkpoint
from freetoken.loader.synth_mxfp4 import convert_experts_to_mxfp4
from freetoken.moe.mxfp4_format import Mxfp4ExpertFormat

STEPS = 16
E = 5


@pytest.fixture(scope="module")
def synth_mxfp4(tmp_path_factory):
    """synth's gpt_oss at the demo sizes (hidden 128, experts 96), as tests/test_gpt_oss_mxfp4.py builds it."""
    out = write_synthetic_checkpoint(tmp_path_factory.mktemp("gpt_oss_mxfp4_cuda"), "gpt_oss", "demo", seed=5,
                                     layers=3, experts=E, top_k=2)
    convert_experts_to_mxfp4(out)
    return out


def _greedy(path, moe_gemm: str, policy: str, slots: int | None) -> list[int]:
    config = EngineConfig(device="cuda", dtype="bfloat16", max_model_len=64,
                          moe=MoeConfig(policy=policy, cache_slots=slots), kernels=KernelConfig(moe_gemm=moe_gemm))
    runner = ModelRunner(str(path), config, rows=1)
    assert isinstance(runner.pool.format, Mxfp4ExpertFormat)
    assert (runner.graphs is not None) == (moe_gemm == "triton")  # the torch loop runs eager
    prompt = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(11)).tolist()
    row = runner.row_pages(0)
    tokens = [int(runner.prefill(row, prompt)[0].argmax())]
    while len(tokens) < STEPS:
        tokens.append(int(runner.decode([row], [tokens[-1]], [len(prompt) + len(tokens) - 1])[0].argmax()))
    runner.close()
    return tokens


@pytest.mark.parametrize("policy, slots", [("resident", None), ("transfer", E)])
def test_triton_mxfp4_gemm_gives_the_torch_loops_greedy_tokens(synth_mxfp4, policy, slots):
    want = _greedy(synth_mxfp4, "torch", policy, slots)
    assert len(set(want)) > 1, "degenerate checkpoint: greedy output is one repeated token"
    assert _greedy(synth_mxfp4, "triton", policy, slots) == want
