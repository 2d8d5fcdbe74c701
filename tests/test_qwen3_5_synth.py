"""Synthetic checkpoints of the hybrid Qwen families (loader/synth_qwen3_5.py) and the engine on them.

Checked: the presets' shapes (the 35B's sizes, `--layers` cuts at the 3:1 pattern, cuts that would
break it refused); the tensors a synthetic checkpoint holds are the ones transformers saves for
the same config (qwen3_5_moe: but for the vision tower, which synth does not write), and
transformers computes what the engine does from them; the engine end to end (AsyncLLM): requests
queued onto fewer rows than requests, prefilled in several chunks and decoded in one batch, each
give transformers' greedy tokens for their prompt alone (so a reused state slot starts from
zeros), and prefix reuse is off, in /health; and the fused dense ops (Triton) compute the reference.
"""

from __future__ import annotations

import anyio
import pytest
import torch
from safetensors import safe_open

from freetoken.config import EngineConfig, ModelConfig, SamplingParams, SchedulerConfig
from freetoken.engine.llm import AsyncLLM
from freetoken.loader.presets import preset_shape
from freetoken.loader.synth import write_synthetic_checkpoint

transformers = pytest.importorskip("transformers")

HYBRID = ("qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")
CLASSES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
           "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
STEPS = 10
PROMPTS = [list(range(40, 77)), [5, 9, 300, 12, 7, 7, 81, 64, 3, 250, 11], list(range(200, 180, -1))]


def test_presets():
    big = preset_shape("qwen3_5_moe", "qwen3.6-35b-a3b")
    assert (big.num_layers, big.hidden_size, big.vocab_size, big.num_experts, big.top_k) == (40, 2048, 248320, 256, 8)
    assert (big.moe_intermediate_size, big.shared_expert_intermediate_size, big.head_dim) == (512, 512, 256)
    assert big.layer_types.count("linear_attention") == 30 and big.layer_types[3::4] == ("full_attention",) * 10
    cut = preset_shape("qwen3_5_moe", "qwen3.6-35b-a3b", layers=12)
    assert cut.layer_types == ("linear_attention",) * 3 + ("full_attention",) + cut.layer_types[:4] * 2
    with pytest.raises(ValueError, match="multiple of 4"):
        preset_shape("qwen3_next", "tiny", layers=6)
    with pytest.raises(ValueError, match="not for arch 'qwen3_moe'"):
        preset_shape("qwen3_moe", "qwen3.6-35b-a3b")
    with pytest.raises(ValueError, match="has the presets"):
        preset_shape("qwen3_5_moe", "demo")


@pytest.mark.parametrize("arch", HYBRID)
def test_large_preset_config_parses_as_transformers_reads_it(arch):
    from freetoken.loader.synth import config_dict

    raw = config_dict(preset_shape(arch, "qwen3.6-35b-a3b", layers=12))
    hf = transformers.AutoConfig.for_model(**raw)
    hf = getattr(hf, "text_config", hf)
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.layer_types == tuple(hf.layer_types) and cfg.layer_types.count("full_attention") == 3
    la = cfg.linear_attention
    assert (la.key_heads, la.value_heads, la.key_dim, la.value_dim, la.conv_width) == (
        hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim, hf.linear_value_head_dim,
        hf.linear_conv_kernel_dim)
    assert cfg.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"] == 0.25
    assert (cfg.num_experts, cfg.top_k, cfg.shared_expert_intermediate_size) == (256, 8, 512)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (16, 2, 256, 248320)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {arch: write_synthetic_checkpoint(tmp_path_factory.mktemp(arch), arch, "tiny", seed=3, dtype="float32")
            for arch in HYBRID}


@pytest.mark.parametrize("arch", HYBRID)
def test_layout_is_transformers(arch, checkpoints, tmp_path):
    path = checkpoints[arch]
    assert ModelConfig.from_dir(path).arch == arch
    model = getattr(transformers, CLASSES[arch])(transformers.AutoConfig.from_pretrained(path))
    model.save_pretrained(tmp_path)
    theirs = set(safe_open(str(tmp_path / "model.safetensors"), "pt").keys())
    ours = set(safe_open(str(path / "model.safetensors"), "pt").keys())
    assert ours == {name for name in theirs if not name.startswith("model.visual.")}


def _reference(path, prompt: list[int]) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, min_new_tokens=STEPS,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_engine_serves_concurrent_chunked_requests(arch, checkpoints):
    path = checkpoints[arch]
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", max_model_len=128, max_running_requests=2,
                          scheduler=SchedulerConfig(prefill_chunk=8))
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)

    async def main():
        async with AsyncLLM.start(config) as llm:
            assert llm.health()["state_anchors"]["kept"] == 0
            results = {}

            async def one(i):
                results[i] = [t async for c in llm.generate(PROMPTS[i], params, f"r{i}") for t in c.token_ids]

            async with anyio.create_task_group() as tg:
                for i in range(len(PROMPTS)):
                    tg.start_soon(one, i)
            # a second turn sharing the first prompt: it resumes from the state saved at the page
            # boundary before that prompt's last token (cache/state_anchors.py)
            again = [c async for c in llm.generate(PROMPTS[0] + [7, 8], params, "again")]
            assert again[-1].cached_tokens == 32
            results["again"] = [t for c in again for t in c.token_ids]
            return results

    results = anyio.run(main)
    assert [results[i] for i in range(len(PROMPTS))] == [_reference(path, p) for p in PROMPTS]
    assert results["again"] == _reference(path, PROMPTS[0] + [7, 8])


def test_fused_dense_ops_compute_the_reference(checkpoints):
    """The engine's fused dense ops (Triton, here under its interpreter) in a hybrid model: the
    zero-centred norms, the rotary over part of each head, the router, the one input projection of
    a linear layer, the causal conv, the gated delta rule (key heads serving value heads) and its
    gated norm, and in the decode step the gated attention's fused kernels (zero-centred q/k norms
    and the partial rotary in the pool write); a prefill and a decode step as the reference's."""
    from freetoken.engine.model_runner import ModelRunner
    from freetoken.models.ops import fused_ops
    from freetoken.models.transformer import MoETransformer

    runner = ModelRunner(str(checkpoints["qwen3_5_moe"]), EngineConfig(device="cpu", dtype="float32",
                                                                       max_model_len=64), rows=1)
    fused = MoETransformer(runner.model_config, runner.weights, runner.model.backend, "cpu", fused_ops())
    prompt, pages, outs = PROMPTS[1], runner.row_pages(0), []
    for model in (runner.model, fused):
        if model is fused:  # the fused path takes the linear layers' four input projections as one, q/k/v too
            for layer in runner.weights.layers:
                layer.attn.fuse_in_proj() if hasattr(layer.attn, "fuse_in_proj") else layer.attn.fuse_qkv()
        slot, n = runner.states.acquire(), len(prompt)
        kv = runner.cache.view([pages], [list(range(n))], n).attach_states(runner.states, [slot])
        first = model.forward(torch.tensor([prompt]), torch.arange(n)[None], kv, n)
        kv = runner.cache.view([pages], [[n]], n + 1).attach_states(runner.states, [slot])
        outs.append((first, model.forward(torch.tensor([[7]]), torch.tensor([[n]]), kv, n + 1)))
        runner.states.release(slot)
    runner.close()
    for ours, reference in zip(outs[1], outs[0], strict=True):
        assert float((ours - reference).abs().max() / reference.abs().max()) < 1e-5
