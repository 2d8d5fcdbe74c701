"""gpt-oss on the CPU engine against transformers' `GptOssForCausalLM` in fp32: prefill logits within
1e-4 of the largest logit and 32 identical greedy tokens, on prompts longer than the sliding window,
for synth's checkpoint (bf16 experts) and one transformers builds and saves at odd sizes (fp32);
in bf16, the logits of 32 greedy steps equal bit for bit those of transformers' eager forward, as do
the sink attention, the biased router and the clamped SwiGLU alone;
every CPU-runnable policy and two cache sizes compute the same tokens; the combinations whose
kernels would compute standard SwiGLU are refused by name. MXFP4 experts (the released
checkpoints' storage) load to the values transformers' own dequantization gives, and compute its
tokens.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from freetoken.config import EngineConfig, KernelConfig, ModelConfig, MoeConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.errors import CheckpointError
from freetoken.loader import presets, synth
from freetoken.loader.synth import write_synthetic_checkpoint
from freetoken.loader.synth_mxfp4 import convert_experts_to_mxfp4
from freetoken.reference.moe import clamped_swiglu
from freetoken.reference.rotary import Rotary

transformers = pytest.importorskip("transformers")

STEPS = 32
MAX_LEN = 128


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    """synth's tiny gpt_oss with odd expert counts: window 16, 3 layers (slide, full, slide)."""
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", "tiny", seed=3, layers=3,
                                      experts=5, top_k=3)


def _save_gpt_oss(out, seed: int, hidden: int, intermediate: int):
    """A checkpoint transformers builds and saves itself (fp32)."""
    torch.manual_seed(seed)
    config = transformers.GptOssConfig(
        num_hidden_layers=2, hidden_size=hidden, head_dim=12, num_attention_heads=6, num_key_value_heads=2,
        intermediate_size=intermediate, num_local_experts=5, num_experts_per_tok=2, vocab_size=300,
        sliding_window=5, max_position_embeddings=512, initializer_range=0.3,
    )
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():  # transformers starts these at zero: give them values to check
        for layer in model.model.layers:
            for bias in (layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias):
                bias.normal_(0, 0.3)
            layer.self_attn.sinks.normal_(0, 1.0)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    """At sizes that are not powers of two."""
    return _save_gpt_oss(tmp_path_factory.mktemp("gpt_oss_saved"), 0, hidden=36, intermediate=20)


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    """Its experts then stored as MXFP4 (sizes multiples of 32)."""
    out = _save_gpt_oss(tmp_path_factory.mktemp("gpt_oss_mxfp4"), 1, hidden=64, intermediate=32)
    convert_experts_to_mxfp4(out)
    return out


def _runner(path, rows=1, **engine) -> ModelRunner:
    return ModelRunner(str(path), EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_LEN, **engine),
                       rows=rows)


def _reference(path):
    # (.float(): transformers dequantizes MXFP4 experts into bf16 whatever dtype is asked for; the
    # values are exact in bf16, so fp32 holds the same weights)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).float().eval()


def _prompt(vocab: int, length: int) -> torch.Tensor:
    return torch.randint(0, min(vocab, 1000), (1, length), generator=torch.Generator().manual_seed(7))


def _greedy(runner: ModelRunner, ids: torch.Tensor) -> list[int]:
    row = runner.row_pages(runner.rows - 1)  # the last row, so a wrong row index cannot pass by accident
    ours = [int(runner.prefill(row, ids[0].tolist()).argmax())]
    while len(ours) < STEPS:
        ours.append(int(runner.decode([row], [ours[-1]], [ids.shape[1] + len(ours) - 1]).argmax()))
    return ours


def _reference_greedy(path, ids: torch.Tensor) -> list[int]:
    with torch.no_grad():
        # (the mask given: generate would otherwise mask every prompt token equal to the pad id)
        out = _reference(path).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS,
                                        min_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_bf16_greedy_steps_equal_transformers_eager_bit_for_bit(tmp_path):
    """bf16 rounds at every op, so greedy tokens agree only where each op rounds where the
    reference's does (sink attention, norms rounded once, the router bias inside its linear:
    a wrong point parted the tokens after 4-11 steps). Checked on the logits themselves, which
    show a wrong rounding point before the tokens do. The prompt and steps pass the window (16)."""
    from benchmarks.parity import ours_greedy

    model_dir = write_synthetic_checkpoint(tmp_path / "gpt_oss", "gpt_oss", "tiny", seed=1, quiet=True)
    ids = _prompt(1024, 20)
    ours, our_logits = ours_greedy(model_dir, ids[0].tolist(), STEPS, "cpu", "bfloat16")
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                                  experts_implementation="eager").eval()
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, min_new_tokens=STEPS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
    steps = zip(our_logits, out.logits, strict=True)
    unequal = [step for step, (a, b) in enumerate(steps) if not torch.equal(a, b[0].float())]
    assert unequal == [], f"steps whose logits differ from transformers' bf16: {unequal}"
    assert ours == out.sequences[0, ids.shape[1]:].tolist()
    assert len(set(ours)) > 1


@pytest.mark.parametrize("score_elements", [1 << 26, 200])  # one slice of queries, or slices of a few
def test_sink_attention_equals_transformers_eager_attention_in_bf16(monkeypatch, score_elements):
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from freetoken.reference import sink_attention as module

    monkeypatch.setattr(module, "SCORE_ELEMENTS", score_elements)
    B, Hq, Hkv, T, D, window = 2, 6, 2, 9, 12, 4
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, h, T, D, generator=g).bfloat16() for h in (Hq, Hkv, Hkv))
    sinks = torch.randn(Hq, generator=g).bfloat16()
    pos = torch.arange(T)
    mask = ((pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)).expand(B, 1, T, T)
    additive = torch.zeros(B, 1, T, T, dtype=torch.bfloat16).masked_fill(~mask, torch.finfo(torch.bfloat16).min)
    stub = SimpleNamespace(num_key_value_groups=Hq // Hkv, sinks=sinks, training=False)
    want, _ = eager_attention_forward(stub, q, k, v, additive, scaling=D**-0.5)  # [B, T, Hq, D]
    ours = module.sink_attention(q, k, v, mask, sinks, D**-0.5)  # [B, Hq, T, D]
    assert torch.equal(ours.transpose(1, 2), want)


@pytest.mark.parametrize("which", ["synth", "saved", "mxfp4"])
def test_prefill_logits_match_transformers(which, synth_dir, saved_dir, mxfp4_dir):
    path = {"synth": synth_dir, "saved": saved_dir, "mxfp4": mxfp4_dir}[which]
    runner = _runner(path)
    ids = _prompt(runner.model_config.vocab_size, 37)  # longer than the window (16, 5)
    kv = runner.cache.view([runner.row_pages(0)], [list(range(ids.shape[1]))], ids.shape[1])
    ours = runner.model.forward(ids, torch.arange(ids.shape[1])[None], kv, ids.shape[1], last_only=False)
    with torch.no_grad():
        theirs = _reference(path)(ids).logits
    rel = (ours - theirs).abs().max() / theirs.abs().max()
    assert rel < 1e-4, f"max relative logit difference {rel:.3g}"


def test_greedy_tokens_match_transformers_on_a_saved_checkpoint(saved_dir):
    ids = _prompt(300, 23)
    ours = _greedy(_runner(saved_dir, rows=2), ids)
    assert ours == _reference_greedy(saved_dir, ids)
    assert len(set(ours)) > 1, "degenerate checkpoint: greedy output is one repeated token"


# (policy, slots): two cache sizes of the dynamic policy (one streaming buffer, two), and static
# with a slot for every expert (the one static placement that routes nothing to the CPU)
POLICIES = [("resident", None), ("transfer", 5), ("transfer", 12), ("static", 15)]


def test_every_cpu_runnable_policy_computes_the_reference_tokens(synth_dir):
    # 70 tokens: prefill chunks long enough to take the streamed / grouped expert path
    ids = _prompt(1024, 70)
    want = _reference_greedy(synth_dir, ids)
    assert len(set(want)) > 1
    for policy, slots in POLICIES:
        runner = _runner(synth_dir, rows=2, moe=MoeConfig(policy=policy, cache_slots=slots))
        assert _greedy(runner, ids) == want, (policy, slots)


@pytest.mark.parametrize(("engine", "match"), [
    ({"moe": MoeConfig(policy="hybrid")}, "policy 'hybrid' computes experts on the CPU with the Numba SwiGLU kernel"),
    ({"moe": MoeConfig(policy="cpu")}, "policy 'cpu' computes experts on the CPU with the Numba SwiGLU kernel"),
    ({"moe": MoeConfig(policy="static", cache_slots=10)}, "policy 'static' computes experts on the CPU"),
    ({"kernels": KernelConfig(moe_gemm="triton")}, "--moe-gemm triton: the Triton slot GEMM computes standard SwiGLU"),
])
def test_kernels_that_compute_standard_swiglu_are_refused(synth_dir, engine, match):
    with pytest.raises(CheckpointError, match=match):
        _runner(synth_dir, **engine)


def test_mxfp4_experts_load_as_transformers_dequantizes_them(mxfp4_dir):
    from contextlib import ExitStack

    from freetoken.loader.checkpoint import open_tensor_reader, read_biased_expert_banks

    raw = json.loads((mxfp4_dir / "config.json").read_text())
    assert raw["quantization_config"]["quant_method"] == "mxfp4"
    config = ModelConfig.from_checkpoint(mxfp4_dir)
    E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
    reference = _reference(mxfp4_dir)
    with ExitStack() as stack:
        reader = open_tensor_reader(mxfp4_dir, stack)
        for i, layer in enumerate(reference.model.layers):
            w13, w2 = torch.empty(E, 2 * I, H + 1), torch.empty(E, H, I + 1)
            read_biased_expert_banks(reader, config, i, torch.float32, out=(w13, w2))
            gate_up, down = layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj  # [E, H, 2I], [E, I, H]
            assert torch.equal(w13[:, :I, :H], gate_up[:, :, 0::2].transpose(1, 2))
            assert torch.equal(w13[:, I:, :H], gate_up[:, :, 1::2].transpose(1, 2))
            assert torch.equal(w2[:, :, :I], down.transpose(1, 2))


def test_greedy_tokens_match_transformers_on_mxfp4_experts(mxfp4_dir):
    ids = _prompt(300, 23)
    ours = _greedy(_runner(mxfp4_dir, rows=2, moe=MoeConfig(policy="transfer", cache_slots=5)), ids)
    assert ours == _reference_greedy(mxfp4_dir, ids)
    assert len(set(ours)) > 1


def test_a_cache_smaller_than_a_layer_is_refused_where_no_cpu_kernel_computes_the_experts(synth_dir):
    # (routes a smaller cache cannot slot go to the CPU kernel, which knows neither biases nor the clamp)
    with pytest.raises(CheckpointError, match="needs at least 5 slots .a layer's experts"):
        _runner(synth_dir, moe=MoeConfig(policy="transfer", cache_slots=4))


def test_other_quantization_methods_are_refused(synth_dir):
    raw = json.loads((synth_dir / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8"}
    with pytest.raises(CheckpointError, match="'fp8' is not supported"):
        ModelConfig.from_hf_dict(raw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_swiglu_matches_transformers(dtype):
    experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(
        transformers.GptOssConfig(hidden_size=8, intermediate_size=6, num_local_experts=2))
    gate_up = (torch.randn(50, 12, generator=torch.Generator().manual_seed(1)) * 6).to(dtype)  # past the limit of 7
    assert (gate_up.abs() > 7).any()
    want = experts._apply_gate(gate_up)  # interleaved: gate in the even columns, up in the odd
    torch.testing.assert_close(clamped_swiglu(gate_up[:, 0::2], gate_up[:, 1::2]), want, rtol=0, atol=0)


def test_biased_router_matches_transformers_in_bf16():
    """The bias inside the router's linear op (one rounding), then the softmax over the top-k."""
    from freetoken.models.ops import REFERENCE_OPS
    from freetoken.models.router import Router

    config = transformers.GptOssConfig(hidden_size=64, num_local_experts=32, num_experts_per_tok=4)
    router = transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter(config).bfloat16()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.weight.copy_(torch.randn(32, 64, generator=g) * 0.3)
        router.bias.copy_(torch.randn(32, generator=g))
        x = torch.randn(200, 64, generator=g).bfloat16()
        want_logits, want_weights, want_ids = router(x)
    ours = Router(ModelConfig.from_hf_dict(config.to_dict()), REFERENCE_OPS)
    logits = ours.logits(x, router.weight.detach(), router.bias.detach())
    weights, ids = ours.route(logits)
    assert torch.equal(logits, want_logits) and torch.equal(ids, want_ids) and torch.equal(weights, want_weights)


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0},
])
def test_yarn_tables_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.GptOssConfig(num_hidden_layers=1, hidden_size=32, head_dim=20, num_attention_heads=2,
                                       num_key_value_heads=1, intermediate_size=8, num_local_experts=2,
                                       num_experts_per_tok=1, vocab_size=10, max_position_embeddings=1024,
                                       rope_parameters=dict(rope))
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](config, None)
    ours = ModelConfig.from_hf_dict(config.to_dict())
    rotary = Rotary(ours.head_dim, ours.rope_theta, "cpu", ours.rope_scaling)
    assert torch.equal(rotary.inv_freq, inv_freq) and rotary.scale == scale


@pytest.mark.parametrize(("preset", "layers", "experts"), [("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)])
def test_real_presets_have_the_real_shapes(preset, layers, experts):
    raw = synth.config_dict(presets.preset_shape("gpt_oss", preset))
    hf = transformers.AutoConfig.for_model(**raw)
    cfg = ModelConfig.from_hf_dict(raw)
    assert (cfg.num_layers, cfg.num_experts, cfg.top_k) == (layers, experts, 4) == (
        hf.num_hidden_layers, hf.num_local_experts, hf.num_experts_per_tok)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.moe_intermediate_size) == (
        2880, 64, 8, 64, 2880)
    assert (cfg.vocab_size, cfg.sliding_window, hf.sliding_window) == (201088, 128, 128)
    assert cfg.sliding_layers == tuple(t == "sliding_attention" for t in hf.layer_types)
    assert cfg.sliding_layers[:2] == (True, False)
    assert math.isclose(cfg.rope_scaling.factor, 32.0) and cfg.rope_scaling.original_max_position_embeddings == 4096
    with pytest.raises(ValueError, match="gpt_oss's shape"):
        presets.preset_shape("qwen3_moe", preset)
