"""gpt-oss's MXFP4 experts served on CUDA by the Triton slot GEMM (kernels/triton/mxfp4_moe_gemm.py):
`--moe-gemm triton` (decode graphs, the blocks decoded in the kernel) against `--moe-gemm torch`
(eager, each routed slot dequantized, then the loop), with every expert resident and with a cache
of a layer's experts filled as decode goes. Both bf16 paths are fed the same tokens (fp32's greedy
ones) and judged against the torch loop in fp32, where MXFP4's values are exact: the kernel
accumulates in fp32 and rounds once where the loop rounds each product's inputs to bf16, so on
random tiny models' near-ties the two bf16 paths may pick different tokens; the kernel must not be
much further from fp32 than the loop and must pick fp32's token at every clear margin."""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig, KernelConfig, MoeConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.loader.synth import write_synthetic_checkpoint
from freetoken.loader.synth_mxfp4 import convert_experts_to_mxfp4
from freetoken.moe.mxfp4_format import Mxfp4ExpertFormat
from tests.logit_margins import check_against_fp32

STEPS = 16
E = 5


@pytest.fixture(scope="module")
def synth_mxfp4(tmp_path_factory):
    """synth's gpt_oss at the demo sizes (hidden 128, experts 96), as tests/test_gpt_oss_mxfp4.py builds it."""
    out = write_synthetic_checkpoint(tmp_path_factory.mktemp("gpt_oss_mxfp4_cuda"), "gpt_oss", "demo", seed=5,
                                     layers=3, experts=E, top_k=2)
    convert_experts_to_mxfp4(out)
    return out


def _logits(path, moe_gemm: str, dtype: str, policy: str, slots: int | None,
            forced: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Each step's logits [STEPS, V] in fp32 and the tokens fed: `forced` if given, else greedy."""
    config = EngineConfig(device="cuda", dtype=dtype, max_model_len=64,
                          moe=MoeConfig(policy=policy, cache_slots=slots), kernels=KernelConfig(moe_gemm=moe_gemm))
    runner = ModelRunner(str(path), config, rows=1)
    assert isinstance(runner.pool.format, Mxfp4ExpertFormat)
    assert (runner.graphs is not None) == (moe_gemm == "triton")  # the torch loop runs eager
    prompt = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(11)).tolist()
    row = runner.row_pages(0)
    logits = [runner.prefill(row, prompt).float().view(-1)]
    tokens: list[int] = []
    while len(logits) < STEPS:
        tokens.append(forced[len(tokens)] if forced else int(logits[-1].argmax()))
        logits.append(runner.decode([row], [tokens[-1]], [len(prompt) + len(tokens) - 1]).float().view(-1))
    runner.close()
    return torch.stack(logits).cpu(), tokens


@pytest.mark.parametrize("policy, slots", [("resident", None), ("transfer", E)])
def test_triton_mxfp4_gemm_keeps_the_torch_loops_tokens(synth_mxfp4, policy, slots):
    truth, tokens = _logits(synth_mxfp4, "torch", "float32", policy, slots)
    assert len(set(tokens)) > 1, "degenerate checkpoint: greedy output is one repeated token"
    want, _ = _logits(synth_mxfp4, "torch", "bfloat16", policy, slots, tokens)
    got, _ = _logits(synth_mxfp4, "triton", "bfloat16", policy, slots, tokens)
    check_against_fp32(got, want, truth, f"{policy} triton vs torch")
