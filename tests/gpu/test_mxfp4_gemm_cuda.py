"""gpt-oss's MXFP4 experts served on CUDA by the Triton slot GEMM (kernels/triton/mxfp4_moe_gemm.py):
`--moe-gemm triton` (decode graphs, the blocks decoded in the kernel) against `--moe-gemm torch`
(eager, each routed slot dequantized, then the loop), with every expert resident, with a cache
of a layer's experts filled as decode goes, and with the misses split with the CPU kernel (hybrid)
or all on it (cpu), all fed the same tokens (fp32's greedy ones).
In fp32, where MXFP4's values are exact, the two paths agree to accumulation order. In bf16 the
kernel accumulates in fp32 and rounds once where the loop rounds each product's inputs, so the
two round differently, and on a random tiny model's near-ties (a token's top-2, a router's top-k)
either may pick differently, moving one step's logits by more: judged against fp32, the kernel's
typical step is no further than the loop's worst, and at every step it picks fp32's token where
the margin exceeds both paths' errors at that step."""

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


# hybrid and cpu: the CPU kernel answers the captured steps' rings (the pollers) and the eager loop's calls alike
@pytest.mark.parametrize("policy, slots", [("resident", None), ("transfer", E), ("hybrid", E), ("cpu", E)])
def test_triton_mxfp4_gemm_keeps_the_torch_loops_tokens(synth_mxfp4, policy, slots):
    truth, tokens = _logits(synth_mxfp4, "torch", "float32", policy, slots)
    assert len(set(tokens)) > 1, "degenerate checkpoint: greedy output is one repeated token"
    exact, _ = _logits(synth_mxfp4, "triton", "float32", policy, slots, tokens)
    assert (exact - truth).abs().max().item() < 1e-3 * truth.abs().max().item()
    want, _ = _logits(synth_mxfp4, "torch", "bfloat16", policy, slots, tokens)
    got, _ = _logits(synth_mxfp4, "triton", "bfloat16", policy, slots, tokens)
    got_err, ref_err = (got - truth).abs().amax(-1), (want - truth).abs().amax(-1)  # [STEPS]
    assert got_err.median().item() <= ref_err.max().item(), f"{got_err.tolist()} vs the loop's {ref_err.tolist()}"
    top2 = truth.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (got_err + ref_err)
    assert bool((got.argmax(-1) == truth.argmax(-1))[clear].all()), "greedy token differs at a clear margin"
