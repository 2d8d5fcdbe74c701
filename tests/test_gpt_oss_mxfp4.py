"""gpt-oss's MXFP4 experts kept as blocks (moe/mxfp4_format.py), on the CPU engine in fp32:
an expert's bytes are its blocks, scales and biases as the checkpoint stores them; every
placement the device computes alone gives logits bit for bit those of a pool dequantized at load;
every policy, the ones computing experts on the CPU kernel (kernels/cpu/mxfp4_experts.py) at two
cache sizes included, gives the greedy tokens of transformers' `GptOssForCausalLM` and logits
within 1e-4 of the largest of resident's; a Triton slot GEMM, which no kernel provides, is refused.
Two checkpoints: synth's (`synth --mxfp4`: bf16 biases, 3 blocks per down row) and one
transformers saves (fp32 biases).
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from freetoken.config import EngineConfig, KernelConfig, MoeConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.errors import CheckpointError
from freetoken.loader.synth import write_synthetic_checkpoint
from freetoken.loader.synth_mxfp4 import convert_experts_to_mxfp4
from freetoken.moe.biased_expert_format import BiasedExpertFormat
from freetoken.moe.mxfp4_format import Mxfp4ExpertFormat
from tests.test_gpt_oss import _reference_greedy, _save_gpt_oss

transformers = pytest.importorskip("transformers")

STEPS = 32
E = 5  # experts per layer in both checkpoints
# (policy, slots) of every placement the device computes alone: two sizes of the dynamic cache
# (one streaming buffer, two) and static with a slot for every expert
DEVICE_POLICIES = [("resident", None), ("transfer", E), ("transfer", 2 * E + 2), ("static", 3 * E)]
# (policy, slots, hybrid's ratio) of the placements that route experts to the CPU kernel
CPU_POLICIES = [("cpu", None, None), ("hybrid", E, None), ("hybrid", 2 * E + 2, 0.5), ("static", E, None),
                ("static", 2 * E + 2, None), ("transfer", 3, None)]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def synth_mxfp4(tmp_path_factory):
    """synth's gpt_oss at the demo sizes (hidden 128, experts 96: multiples of 32), 3 layers."""
    out = write_synthetic_checkpoint(tmp_path_factory.mktemp("gpt_oss_mxfp4_synth"), "gpt_oss", "demo", seed=5,
                                     layers=3, experts=E, top_k=2)
    convert_experts_to_mxfp4(out)
    return out


@pytest.fixture(scope="module")
def saved_mxfp4(tmp_path_factory):
    out = _save_gpt_oss(tmp_path_factory.mktemp("gpt_oss_mxfp4_saved"), 2, hidden=64, intermediate=32)
    convert_experts_to_mxfp4(out)
    return out


@pytest.fixture(params=["synth", "saved"])
def checkpoint(request, synth_mxfp4, saved_mxfp4):
    return {"synth": synth_mxfp4, "saved": saved_mxfp4}[request.param]


def _runner(path, policy="resident", slots=None, ratio=None, **engine) -> ModelRunner:
    moe = MoeConfig(policy=policy, cache_slots=slots, cpu_threads=1, params={"ratio": ratio} if ratio else {})
    return ModelRunner(str(path), EngineConfig(device="cpu", dtype="float32", max_model_len=128, moe=moe, **engine),
                       rows=1)


def _greedy(runner: ModelRunner, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of one sequence, and the logits of each step."""
    row = runner.row_pages(0)
    logits = [runner.prefill(row, prompt)[0]]
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < STEPS:
        logits.append(runner.decode([row], [tokens[-1]], [len(prompt) + len(tokens) - 1])[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


def _prompt(length: int) -> list[int]:
    # 70 tokens: prefill chunks long enough to take the streamed / grouped expert path
    return torch.randint(0, 300, (length,), generator=torch.Generator().manual_seed(11)).tolist()


def _expert_tensor_bytes(path, layer: int) -> int:
    """One expert's bytes of `layer` as the checkpoint's files store them."""
    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                if name.startswith(f"model.layers.{layer}.mlp.experts."):
                    total += f.get_tensor(name).nbytes // E
    return total


def test_an_expert_is_its_blocks_scales_and_biases(checkpoint):
    runner = _runner(checkpoint)
    pool, cfg = runner.pool, runner.model_config
    assert isinstance(pool.format, Mxfp4ExpertFormat)
    stored = _expert_tensor_bytes(checkpoint, 0)
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    weights = 3 * H * I
    assert stored == weights * 17 // 32 + (2 * I + H) * pool.format.bias_dtype.itemsize  # 4.25 bits/weight
    assert stored <= pool.expert_bytes < stored + 32  # two rows, each padded to 16 bytes
    slots = runner.slots
    assert slots.w13.dtype == torch.uint8 and slots.w13[0].numel() + slots.w2[0].numel() == pool.expert_bytes
    assert pool.format.slot_bytes(cfg, torch.float32) == pool.expert_bytes
    assert pool.nbytes == cfg.num_layers * E * pool.expert_bytes == runner.report.pool_bytes
    bf16 = BiasedExpertFormat("bf16+bias", torch.bfloat16, cpu_executable=False, summary="").expert_bytes(cfg)
    assert bf16 / pool.expert_bytes > 3.2


def test_every_placement_computes_the_dequantized_pools_logits_bit_for_bit(checkpoint, monkeypatch):
    prompt = _prompt(70)
    kept = {placement: _greedy(_runner(checkpoint, *placement), prompt) for placement in DEVICE_POLICIES}
    # the pool as it was before: the experts dequantized into bf16/fp32 rows at load
    monkeypatch.setattr("freetoken.moe.formats.mxfp4_format_for", lambda reader, config: None)
    for placement, (tokens, logits) in kept.items():
        runner = _runner(checkpoint, *placement)
        assert not isinstance(runner.pool.format, Mxfp4ExpertFormat)
        want_tokens, want_logits = _greedy(runner, prompt)
        assert tokens == want_tokens, placement
        assert torch.equal(logits, want_logits), placement


def test_every_placement_computes_transformers_greedy_tokens(synth_mxfp4):
    prompt = _prompt(70)
    want = _reference_greedy(synth_mxfp4, torch.tensor([prompt]))
    assert len(set(want)) > 1, "degenerate checkpoint: greedy output is one repeated token"
    for placement in DEVICE_POLICIES:
        assert _greedy(_runner(synth_mxfp4, *placement), prompt)[0] == want, placement


def test_the_cpu_policies_compute_transformers_greedy_tokens(synth_mxfp4):
    prompt = _prompt(70)
    want = _reference_greedy(synth_mxfp4, torch.tensor([prompt]))
    _, resident = _greedy(_runner(synth_mxfp4), prompt)
    for placement in CPU_POLICIES:
        runner = _runner(synth_mxfp4, *placement)
        assert runner.executor is not None
        tokens, logits = _greedy(runner, prompt)
        runner.close()
        assert sum(runner.slots.stats.cpu_routes) > 0, placement  # the CPU kernel computed some
        assert tokens == want, placement
        assert (logits - resident).abs().max() / resident.abs().max() < TOLERANCE, placement


@pytest.mark.parametrize("policy, slots", [("resident", None), ("transfer", 5)])
def test_the_triton_slot_gemm_serves_the_torch_loops_tokens(saved_mxfp4, policy, slots):
    """--moe-gemm triton (kernels/triton/mxfp4_moe_gemm.py, under the interpreter here) against the
    exact dequantizing loop: the same greedy tokens, logits within the fp32 sums' reordering."""
    prompt = _prompt(12)
    want_tokens, want_logits = _greedy(_runner(saved_mxfp4, policy, slots), prompt)
    tokens, logits = _greedy(_runner(saved_mxfp4, policy, slots, kernels=KernelConfig(moe_gemm="triton")), prompt)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5 * float(want_logits.abs().max()))


def test_other_slot_gemms_are_refused_by_name(saved_mxfp4):
    from freetoken.moe.mxfp4_format import Mxfp4ExpertFormat

    with pytest.raises(CheckpointError, match="--moe-gemm fused"):
        Mxfp4ExpertFormat(64, 64, torch.bfloat16).slot_gemm("fused", 0)
