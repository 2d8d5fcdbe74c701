"""The fused decode path (kernels/triton/: fused q/k/v projection, q/k norm + rotary + pool
write in one kernel, paged decode attention, add+norm, routing) against the reference ops, on
whole tiny models of every family. Without a GPU the kernels run in Triton's interpreter.

The fused kernels round where the reference rounds but sum in other orders, so logits agree
within a small tolerance and greedy tokens are the same; the first layer's KV pool holds what
the reference steps write.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig, MoeConfig
from freetoken.engine.decode_graphs import key_bucket
from freetoken.engine.model_runner import ModelRunner
from freetoken.kernels.triton.decode_attention import num_key_splits
from freetoken.models.ops import fused_ops
from freetoken.models.transformer import MoETransformer, fused_decode_supported


def _fused(runner: ModelRunner) -> MoETransformer:
    """The runner's model rebuilt on the ops the engine uses on CUDA (the runner on the CPU keeps
    the reference ops)."""
    cfg = runner.model_config
    if fused_decode_supported(cfg):
        for layer in runner.weights.layers:
            layer.attn.fuse_qkv()
    return MoETransformer(cfg, runner.weights, runner.model.backend, "cpu", fused_ops())


def _close(got: torch.Tensor, want: torch.Tensor, msg: str = "") -> None:
    """Within a few bf16 roundings of the tensor's scale (a wrong kernel is off by the scale)."""
    scale = float(want.float().abs().max())
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.02 * scale, msg=msg or None)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_fused_decode_matches_the_reference(arch, make_checkpoint):
    model_dir = make_checkpoint(arch, "tiny", seed=3)
    config = EngineConfig(device="cpu", max_model_len=256, moe=MoeConfig(policy="resident"), dtype="bfloat16")
    ref, fused = ModelRunner(str(model_dir), config, rows=2), ModelRunner(str(model_dir), config, rows=2)
    fused.model = _fused(fused)
    assert fused.model.fused_decode == (arch != "olmoe")  # OLMoE norms q/k before the head split
    # A 130-token prompt puts the batch in the 256-key bucket: attention splits its keys, and the
    # short sequence's second split holds no keys at all.
    prompts = [[2 + (7 * i) % 50 for i in range(130)], [11, 3, 60, 8]]
    assert num_key_splits(2, fused.model_config.num_kv_heads, key_bucket(131)) > 1
    tokens, positions = [], []
    for row, prompt in enumerate(prompts):
        want = ref.prefill(ref.row_pages(row), prompt)
        got = fused.prefill(fused.row_pages(row), prompt)
        _close(got, want)
        tokens.append(int(want.argmax()))
        positions.append(len(prompt))
    pages = [ref.row_pages(r) for r in range(2)]
    for step in range(4):  # a two-sequence batch of different lengths, keys padded to the bucket
        kv_ref = ref.cache.view(pages, [[p] for p in positions], max(positions) + 1)
        kv_fused = fused.cache.view(pages, [[p] for p in positions], key_bucket(max(positions) + 1), padded=True)
        t = torch.tensor(tokens)[:, None]
        p = torch.tensor(positions)[:, None]
        want = ref.model.forward(t, p, kv_ref, max(positions) + 1)
        got = fused.model.forward(t, p, kv_fused, key_bucket(max(positions) + 1))
        _close(got, want, f"step {step}")
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), step
        tokens = want.argmax(-1).tolist()
        positions = [q + 1 for q in positions]
    z = ref.cache.page_size
    rows = torch.tensor([pages[r][q // z] * z + q % z for r in range(2) for q in range(positions[r])])
    # Layer 0's keys and values, from the same embeddings: what the fused prep kernel wrote where
    # the reference wrote. (Deeper layers see one-ulp differences, which can flip a near-tied
    # expert choice for a token: its keys then differ by more than rounding.)
    _close(fused.cache.k[0, rows], ref.cache.k[0, rows])
    _close(fused.cache.v[0, rows], ref.cache.v[0, rows])
    ref.close()
    fused.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_one_token_steps_run_the_norms_inside_the_kernels_after_them(arch, make_checkpoint, monkeypatch):
    """At one row the input norm runs inside the q/k/v projection and the post-attention add and
    norm inside the router's linear layer (kernels/triton/norm_linear.py): two launches a layer,
    and the same tokens as the reference."""
    from freetoken.kernels.triton import norm_linear

    model_dir = make_checkpoint(arch, "tiny", seed=5)
    config = EngineConfig(device="cpu", max_model_len=64, moe=MoeConfig(policy="resident"), dtype="bfloat16")
    ref, fused = ModelRunner(str(model_dir), config, rows=1), ModelRunner(str(model_dir), config, rows=1)
    fused.model = _fused(fused)
    launched = []
    real = norm_linear._launch

    def counted(*args):
        launched.append("router" if args[-1] else "project")  # (the router keeps its normed rows)
        return real(*args)

    monkeypatch.setattr(norm_linear, "_launch", counted)
    prompt = [5, 9, 2, 31, 7]
    want = ref.prefill(ref.row_pages(0), prompt)
    _close(fused.prefill(fused.row_pages(0), prompt), want)
    token = int(want.argmax())
    assert not launched  # prompts keep the separate kernels
    pages, position = [ref.row_pages(0)], len(prompt)
    for step in range(3):
        t, p = torch.tensor([[token]]), torch.tensor([[position]])
        want = ref.model.forward(t, p, ref.cache.view(pages, [[position]], position + 1), position + 1)
        bucket = key_bucket(position + 1)
        got = fused.model.forward(t, p, fused.cache.view(pages, [[position]], bucket, padded=True), bucket)
        _close(got, want, f"step {step}")
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), step
        token, position = int(want.argmax()), position + 1
    layers = fused.model_config.num_layers
    assert launched == ["project", "router"] * layers * 3
    ref.close()
    fused.close()


@pytest.mark.parametrize("rows", [1, 4, 6])
def test_norm_router_and_projection_past_the_fused_rows(rows):
    """More rows than the fused launches take (6 > MAX_ROWS for the router, > 1 for the
    projection) fall back to the separate kernels, with the same results as the twin."""
    from freetoken.kernels.triton.norm_linear import norm_linear_twin, norm_project, norm_router

    g = torch.Generator().manual_seed(rows)
    h, delta = (torch.randn(rows, 1, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    norm_w = (1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16)
    router_w, wqkv = (torch.randn(n, 64, generator=g).div(8).to(torch.bfloat16) for n in (16, 96))
    total, x, logits = norm_router(h, delta, norm_w, 1e-6, router_w)
    want_total, want_x, want_logits = norm_linear_twin(h, delta, norm_w, 1e-6, router_w)
    assert torch.equal(total, want_total)
    _close(x, want_x)
    _close(logits, want_logits.view(rows, -1))
    total, qkv = norm_project(h, None, norm_w, 1e-6, wqkv)
    assert total is h or torch.equal(total, h)
    _close(qkv, norm_linear_twin(h, None, norm_w, 1e-6, wqkv)[2].view(rows, -1))
