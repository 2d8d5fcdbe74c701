"""Qwen3-Next and Qwen3.5-MoE (qwen3_next, qwen3_5_moe_text, and the vision-language qwen3_5_moe)
against transformers: tiny checkpoints of odd sizes that transformers builds and saves (fp32),
run through the engine's model runner on the CPU (fp32).

Checked per model type: the prompt's logits at every position within LOGIT_RTOL of the largest
logit; then two sequences at once, each prompt prefilled in chunks interleaved with the other's
(so a chunk must continue its own sequence's recurrent state, not the other's), then decoded
together for STEPS greedy tokens, each step's logits within the same bound and the same token as
transformers' own generation of that prompt alone. Near-ties (the reference's top-2 margin below
TIE_RTOL of its largest logit) end the comparison at that step, as in tests/test_parity_sweep.py.
Also: the placement policies that run experts elsewhere (cpu, hybrid, transfer) on one model
type, from a bf16 checkpoint (the CPU branch computes from bf16 banks); experts stored fused
(gate_up_proj / down_proj) load as the per-expert ones do; bad configs refused with a clear
CheckpointError.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from freetoken.config import EngineConfig, ModelConfig, MoeConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.errors import CheckpointError
from freetoken.loader.synth import EMBED_STD, LM_HEAD_GAIN, NORM_NOISE, ROUTER_GAIN

transformers = pytest.importorskip("transformers")

LOGIT_RTOL = 1e-4
TIE_RTOL = 2 * LOGIT_RTOL
STEPS = 32
POLICY_STEPS = 8
MAX_LEN = 96
CHUNK = 16  # prefill chunk: the prompts span three chunks
PROMPT_LENS = (37, 41)

# Odd sizes: 3 query heads over 1 KV head, 2 linear key heads each serving 3 value heads of odd
# dims, 4 layers at the families' 3:1 pattern (layer 3 is full attention).
TEXT = dict(vocab_size=97, hidden_size=44, num_hidden_layers=4, num_attention_heads=3, num_key_value_heads=1,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=6,
            linear_value_head_dim=5, linear_conv_kernel_dim=4, moe_intermediate_size=20,
            shared_expert_intermediate_size=18, num_experts=5, num_experts_per_tok=2, max_position_embeddings=512,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
VISION = dict(depth=1, hidden_size=16, intermediate_size=20, num_heads=2, out_hidden_size=44)

MODEL_TYPES = {
    "qwen3_next": lambda: transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**TEXT)),
    "qwen3_5_moe_text": lambda: transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**TEXT)),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeForConditionalGeneration(
        transformers.Qwen3_5MoeConfig(text_config=TEXT, vision_config=VISION)),
}


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights at the synthetic checkpoints' scales (transformers' init leaves logits nearly flat);
    the zero-centred norms near 0, the DeltaNet's output norm near 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + NORM_NOISE * noise)
            elif "norm" in name:
                p.copy_(NORM_NOISE * noise)
            elif "embed_tokens" in name:
                p.copy_(EMBED_STD * noise)
            elif name.startswith("lm_head"):
                p.copy_(LM_HEAD_GAIN / math.sqrt(p.shape[-1]) * noise)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(ROUTER_GAIN / math.sqrt(p.shape[-1]) * noise)
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 8 + 0.5))
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """model type -> (fp32 checkpoint dir, its transformers model)."""
    out = {}
    for seed, (arch, build) in enumerate(MODEL_TYPES.items()):
        torch.manual_seed(seed)
        model = build()
        _randomise(model, seed)
        path = tmp_path_factory.mktemp(arch)
        model.save_pretrained(path)
        out[arch] = (path, model.eval())
    return out


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, TEXT["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _reference(model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens for `prompt` alone and the logits each was picked from."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    return gen.sequences[0, len(prompt):].tolist(), [step[0] for step in gen.logits]


def _rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def _runner(path, policy: str = "resident", slots: int | None = None) -> ModelRunner:
    engine = EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_LEN,
                          moe=MoeConfig(policy=policy, cache_slots=slots, cpu_threads=1))
    return ModelRunner(str(path), engine, rows=2)


def _check_two_sequences(runner: ModelRunner, model, steps: int = STEPS) -> None:
    prompts = _prompts()
    refs = [_reference(model, p, steps) for p in prompts]
    slots = [runner.states.acquire() for _ in prompts]
    pages = [runner.row_pages(b) for b in range(len(prompts))]
    logits: list[torch.Tensor | None] = [None] * len(prompts)
    for start in range(0, max(PROMPT_LENS), CHUNK):  # chunk by chunk, the two prompts in turn
        for b, prompt in enumerate(prompts):
            if start < len(prompt):
                logits[b] = runner.prefill(pages[b], prompt[start:start + CHUNK], start, state_slot=slots[b])[0]
    live = list(range(len(prompts)))  # sequences still compared
    for step in range(steps):
        for b in list(live):
            tokens, theirs = refs[b][0][step], refs[b][1][step]
            rel = _rel(logits[b], theirs)
            assert rel < LOGIT_RTOL, f"sequence {b}, step {step}: logits differ by {rel:.3g}"
            top2 = theirs.topk(2).values
            if top2[0] - top2[1] < TIE_RTOL * theirs.abs().max():
                live.remove(b)  # a near-tie: not compared from here on
                continue
            assert int(logits[b].argmax()) == tokens, f"sequence {b}, step {step}: another token"
        if not live:
            break
        out = runner.decode([pages[b] for b in live], [refs[b][0][step] for b in live],
                            [len(prompts[b]) + step for b in live], [slots[b] for b in live])
        for row, b in enumerate(live):
            logits[b] = out[row]
    assert step >= steps // 2, f"near-ties ended the comparison at step {step}"


@pytest.mark.parametrize("arch", sorted(MODEL_TYPES))
def test_matches_transformers(arch, checkpoints):
    path, model = checkpoints[arch]
    assert ModelConfig.from_dir(path).arch == arch
    prompt = _prompts()[0]
    with torch.no_grad():
        full = model(torch.tensor([prompt])).logits[0]
    runner = _runner(path)
    try:
        n, slot = len(prompt), runner.states.acquire()
        kv = runner.cache.view([runner.row_pages(0)], [list(range(n))], n).attach_states(runner.states, [slot])
        ours = runner.model.forward(torch.tensor([prompt]), torch.arange(n)[None], kv, n, last_only=False)[0]
        assert _rel(ours, full) < LOGIT_RTOL, f"prefill logits differ by {_rel(ours, full):.3g}"
        runner.states.release(slot)
        _check_two_sequences(runner, model)
    finally:
        runner.close()


@pytest.mark.parametrize("policy", ["cpu", "hybrid", "transfer"])
def test_placement_policies(policy, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"qwen3_5_{policy}")
    model = MODEL_TYPES["qwen3_5_moe_text"]()
    _randomise(model, 5)
    model.to(torch.bfloat16).save_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = _runner(path, policy, slots=3)
    try:  # (fewer steps: what these policies change is where each step's experts run)
        _check_two_sequences(runner, model, POLICY_STEPS)
    finally:
        runner.close()


def _text_config(**changes) -> dict:
    raw = {**TEXT, "model_type": "qwen3_5_moe_text"}
    raw.update(changes)
    return raw


@pytest.mark.parametrize("changes, message", [
    ({"linear_num_value_heads": 5}, "linear_num_key_heads: 2 does not divide linear_num_value_heads"),
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
     "layer_types: unknown layer type 'sliding_attention'"),
    ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types: lists 2 layers, but num_hidden_layers"),
    ({"layer_types": ["linear_attention"] * 4}, "layer_types: no full_attention layer"),
    ({"partial_rotary_factor": 0.1}, "partial_rotary_factor"),
    ({"attn_output_gate": False}, "attn_output_gate: false"),
    ({"head_dim": 13}, "partial_rotary_factor: 0.25 of head_dim 13 gives 3"),
])
def test_bad_configs_are_refused(changes, message, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_text_config(**changes)))
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_dir(tmp_path)
    nested = {"model_type": "qwen3_5_moe", "text_config": _text_config(**changes), "vision_config": VISION}
    with pytest.raises(CheckpointError, match=f"text_config: {message}"):
        ModelConfig.from_hf_dict(nested)


def test_fused_expert_tensors_load_as_per_expert_ones(checkpoints, tmp_path):
    """qwen3_5_moe's experts as fused tensors (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I], the layout transformers computes with) give the same model as per-expert ones."""
    from safetensors.torch import load_file, save_file

    path, _ = checkpoints["qwen3_5_moe"]
    tensors = load_file(str(path / "model.safetensors"))
    E = TEXT["num_experts"]
    for layer in range(TEXT["num_hidden_layers"]):
        base = f"model.language_model.layers.{layer}.mlp.experts."
        parts = {name: [tensors.pop(f"{base}{e}.{name}.weight") for e in range(E)]
                 for name in ("gate_proj", "up_proj", "down_proj")}
        tensors[base + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in
                                                      zip(parts["gate_proj"], parts["up_proj"], strict=True)])
        tensors[base + "down_proj"] = torch.stack(parts["down_proj"])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    prompt = _prompts()[1]
    logits = []
    for model_dir in (path, tmp_path):
        runner = _runner(model_dir)
        try:
            logits.append(runner.prefill(runner.row_pages(0), prompt, state_slot=runner.row_state_slot(0)))
        finally:
            runner.close()
    assert _rel(logits[1], logits[0]) < 1e-6  # (the same banks; only a GEMM's summation order may differ)
