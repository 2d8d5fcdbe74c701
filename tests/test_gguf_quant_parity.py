"""Quantized GGUF files served from their blocks against transformers' GGUF loader (which
dequantizes every tensor with the `gguf` package and computes in fp32).

fp32: prefill logits within 1e-4 relative (to the largest logit) and 32 identical greedy tokens.
Every policy and cache size computes the same tokens from the same blocks: the slot GEMM's twin
(dequantize, then the reference loop) for slots, the Numba block kernel for CPU routes.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig, MoeConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.loader.gguf_writer import tensor_type
from freetoken.loader.synth_gguf import write_synthetic_gguf
from freetoken.moe.block_format import BlockQuantFormat
from freetoken.quant.ggml_blocks import GGMLType

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' GGUF loader needs it

STEPS = 32
# (file type, layers): a Q4_K_M file of 8 layers mixes Q4_K and Q6_K down projections
FILES = [("Q8_0", 2), ("Q4_K_M", 8), ("Q6_K", 2)]
# (policy, slots) over a pool of L * 4 experts: resident holds all; the others hold a layer or less
PLACEMENTS = [("resident", None), ("transfer", 3), ("static", 6), ("cpu", 2), ("hybrid", 5), ("hybrid", 12)]


@pytest.fixture(scope="module", params=FILES, ids=lambda f: f"{f[0]}-{f[1]}layers")
def gguf_file(request, tmp_path_factory):
    file_type, layers = request.param
    out = tmp_path_factory.mktemp("gguf") / f"tiny-{file_type}.gguf"
    return write_synthetic_gguf(out, "qwen3_moe", "tiny-gguf", file_type=file_type, layers=layers, experts=4,
                                seed=5)


def _runner(path, policy: str = "resident", slots: int | None = None, rows: int = 1) -> ModelRunner:
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", max_model_len=128,
                          moe=MoeConfig(policy=policy, cache_slots=slots, cpu_threads=1))
    return ModelRunner(str(path), config, rows=rows)


def _reference(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def _prompt(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, 13), generator=torch.Generator().manual_seed(7))


def _greedy(runner: ModelRunner, ids: torch.Tensor) -> list[int]:
    logits = runner.prefill(runner.row_pages(0), ids[0].tolist())
    out = [int(logits.argmax())]
    while len(out) < STEPS:
        out.append(int(runner.decode([runner.row_pages(0)], [out[-1]], [ids.shape[1] + len(out) - 1]).argmax()))
    return out


def test_the_pool_keeps_the_files_blocks(gguf_file):
    runner = _runner(gguf_file)
    try:
        fmt = runner.pool.format
        assert isinstance(fmt, BlockQuantFormat)
        layers = runner.model_config.num_layers
        file_type = gguf_file.stem.split("-")[1]
        assert [d for _, d in fmt.layer_types] == [tensor_type(file_type, "ffn_down_exps", i, layers)
                                                   for i in range(layers)]
        if file_type == "Q4_K_M":  # both down types, so the banks are as wide as the Q6_K layers
            assert {d for _, d in fmt.layer_types} == {GGMLType.Q4_K, GGMLType.Q6_K}
        assert runner.pool.w13.dtype == torch.uint8
        assert runner.pool.nbytes == runner.pool.w13.shape[0] * fmt.expert_bytes(runner.model_config)
    finally:
        runner.close()


def test_prefill_logits_match_transformers(gguf_file):
    runner = _runner(gguf_file)
    try:
        ids = _prompt(runner.model_config.vocab_size)
        positions = torch.arange(ids.shape[1])[None]
        kv = runner.cache.view([runner.row_pages(0)], [list(range(ids.shape[1]))], ids.shape[1])
        ours = runner.model.forward(ids, positions, kv, ids.shape[1], last_only=False)
    finally:
        runner.close()
    with torch.no_grad():
        theirs = _reference(gguf_file)(ids).logits
    rel = (ours - theirs).abs().max() / theirs.abs().max()
    assert rel < 1e-4, f"max relative logit difference {rel:.3g}"


def test_greedy_tokens_match_transformers_under_every_placement(gguf_file):
    ids = _prompt(1024)
    with torch.no_grad():
        theirs = _reference(gguf_file).generate(
            ids, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, ids.shape[1] :].tolist()
    assert len(set(theirs)) > 1, "degenerate checkpoint: greedy output is one repeated token"
    for policy, slots in PLACEMENTS:
        runner = _runner(gguf_file, policy, slots)
        try:
            assert _greedy(runner, ids) == theirs, f"{policy} with {slots} slots"
        finally:
            runner.close()


def test_filling_the_pool_reads_the_file_without_keeping_its_pages(tmp_path):
    """The pool takes the experts with file reads: its load grows the process by the pool, not by
    the pool plus the mapped file's pages (the peak, VmHWM, is measured in a fresh process and reset
    by Linux's clear_refs after the imports)."""
    import subprocess
    import sys

    path = write_synthetic_gguf(tmp_path / "m.gguf", "qwen3_moe", "tiny-gguf", file_type="Q4_K_M", layers=4,
                                experts=128, seed=1)
    probe = (
        "import sys\n"
        "from freetoken.config import ModelConfig\n"
        "from freetoken.cache.host_pool import HostExpertPool\n"
        "def peak():\n"
        "    line = next(x for x in open('/proc/self/status') if x.startswith('VmHWM:'))\n"
        "    return int(line.split()[1]) * 1024\n"
        "cfg = ModelConfig.from_checkpoint(sys.argv[1])\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"  # the peak so far (imports) is forgotten
        "before = peak()\n"
        "pool = HostExpertPool.load(sys.argv[1], cfg)\n"
        "print(peak() - before, pool.nbytes)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, check=True)
    growth, pool_bytes = map(int, out.stdout.split())
    assert pool_bytes > 50e6
    assert growth < 1.25 * pool_bytes, f"a {pool_bytes / 1e6:.0f} MB pool grew the process by {growth / 1e6:.0f} MB"


def test_the_prefill_gemm_over_a_layer_equals_the_slot_loop(gguf_file):
    """A streamed or resident layer's prefill GEMM (the layer dequantized at once, then the grouped
    GEMM) computes the slot loop's result on the same blocks."""
    runner = _runner(gguf_file)
    try:
        pool, cfg = runner.pool, runner.model_config
        fmt, E, layer = pool.format, cfg.num_experts, cfg.num_layers - 1
        w13, w2 = pool.w13[layer * E : (layer + 1) * E], pool.w2[layer * E : (layer + 1) * E]
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(70, cfg.hidden_size, generator=gen)
        ids = torch.stack([torch.randperm(E, generator=gen)[: cfg.top_k] for _ in range(70)]).to(torch.int32)
        weights = torch.rand(70, cfg.top_k, generator=gen)
        streamed = fmt.prefill_gemm(layer)(x, weights, ids, w13, w2)
        looped = fmt.slot_gemm("torch", layer)(x, weights, ids, w13, w2)
    finally:
        runner.close()
    assert (streamed - looped).abs().max() <= 1e-5 * looped.abs().max()
