"""How a bf16 path's logits are judged against fp32 on random tiny models, which have near-ties
where any two bf16 paths may pick different greedy tokens: the path under test must not be much
further from fp32 than the reference bf16 path is, and must pick fp32's token wherever fp32's top-2
margin exceeds the two paths' errors."""

from __future__ import annotations

import torch


def check_against_fp32(got: torch.Tensor, want: torch.Tensor, truth: torch.Tensor, what: str) -> None:
    """got: bf16 logits of the path under test, want: reference bf16 logits, truth: fp32 logits [R, V]."""
    got_err = (got - truth).abs().max().item()
    ref_err = (want - truth).abs().max().item()
    assert got_err <= 2 * ref_err + 0.02, f"{what}: {got_err:.4f} from fp32, reference bf16 {ref_err:.4f}"
    top2 = truth.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (got_err + ref_err)
    assert bool((got.argmax(-1) == truth.argmax(-1))[clear].all()), f"{what}: greedy token differs at a clear margin"
