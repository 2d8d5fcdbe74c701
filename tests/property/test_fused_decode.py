"""The fused decode path (kernels/triton/: fused q/k/v projection, q/k norm + rotary + pool
write in one kernel, paged decode attention, add+norm, routing) against the reference ops, on
whole tiny models of every family. Without a GPU the kernels run in Triton's interpreter.

The fused kernels round where the reference rounds but sum in other orders, so logits agree
within a small tolerance and greedy tokens are the same; the KV pool the fused steps write
holds what the reference steps write.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine.decode_graphs import key_bucket
from freetoken.engine.model_runner import ModelRunner
from freetoken.kernels.triton.rms_norm import fused_add_rms_norm, fused_rms_norm
from freetoken.kernels.triton.rotary import fused_rotary
from freetoken.kernels.triton.routing import fused_route
from freetoken.models.transformer import MoETransformer


def _fused(runner: ModelRunner) -> MoETransformer:
    for layer in runner.weights.layers:
        layer.attn.fuse_qkv()
    return MoETransformer(runner.model_config, runner.weights, runner.model.backend, "cpu", norm=fused_rms_norm,
                          rotate=fused_rotary, add_norm=fused_add_rms_norm, router=fused_route, fused_decode=True)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_fused_decode_matches_the_reference(arch, make_checkpoint):
    model_dir = make_checkpoint(arch, "tiny", seed=3)
    config = EngineConfig(device="cpu", max_model_len=256, moe_policy="resident", dtype="bfloat16")
    ref, fused = ModelRunner(str(model_dir), config, rows=2), ModelRunner(str(model_dir), config, rows=2)
    fused.model = _fused(fused)
    assert fused.model.fused_decode == (arch != "olmoe")  # OLMoE norms q/k before the head split
    prompts = [[5, 17, 33, 2, 9, 41, 7], [11, 3, 60, 8]]
    tokens, positions = [], []
    for row, prompt in enumerate(prompts):
        want = ref.prefill(ref.row_pages(row), prompt)
        got = fused.prefill(fused.row_pages(row), prompt)
        torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)
        tokens.append(int(want.argmax()))
        positions.append(len(prompt))
    pages = [ref.row_pages(r) for r in range(2)]
    for step in range(6):  # a two-sequence batch of different lengths, keys padded to the bucket
        kv_ref = ref.cache.view(pages, [[p] for p in positions], max(positions) + 1)
        kv_fused = fused.cache.view(pages, [[p] for p in positions], key_bucket(max(positions) + 1), padded=True)
        t = torch.tensor(tokens)[:, None]
        p = torch.tensor(positions)[:, None]
        want = ref.model.forward(t, p, kv_ref, max(positions) + 1)
        got = fused.model.forward(t, p, kv_fused, key_bucket(max(positions) + 1))
        torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05, msg=f"step {step}")
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), step
        tokens = want.argmax(-1).tolist()
        positions = [q + 1 for q in positions]
    written = [q for r in range(2) for q in range(positions[r])]
    rows = torch.tensor([pages[r][q // ref.cache.page_size] * ref.cache.page_size + q % ref.cache.page_size
                         for r in range(2) for q in range(positions[r])])
    assert len(written) == len(rows)
    torch.testing.assert_close(fused.cache.k[:, rows].float(), ref.cache.k[:, rows].float(), rtol=0.05, atol=0.05)
    torch.testing.assert_close(fused.cache.v[:, rows].float(), ref.cache.v[:, rows].float(), rtol=0.05, atol=0.05)
    ref.close()
    fused.close()
