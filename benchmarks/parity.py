"""Greedy-token parity of our engine against transformers on the same checkpoint.

Used by tests/gpu (bf16 on CUDA) and runnable as a script that writes a JSON report:

    python -m benchmarks.parity --device cuda --dtype bfloat16 --presets tiny small --out results.json

For every family and preset it records how many greedy tokens agree (out of --steps), the first
divergence and the logit margin there, against transformers' eager experts loop (the reference
whose rounding points we mirror) and its default grouped-GEMM experts path.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from freetoken.config import SUPPORTED_ARCHS, EngineConfig, KernelConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.loader.synth import write_synthetic_checkpoint


def ours_greedy(
    model_dir: Path, prompt: list[int], steps: int, device: str, dtype: str, moe_gemm: str = "torch",
    dense_kernels: str = "reference",
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens from a ModelRunner. By default the torch expert loop and the reference dense
    ops: transformers' bf16 rounding points (the engine's defaults are the fused kernels)."""
    config = EngineConfig(device=device, dtype=dtype, max_model_len=len(prompt) + steps + 1,
                          kernels=KernelConfig(moe_gemm=moe_gemm, dense=dense_kernels))
    runner = ModelRunner(str(model_dir), config, rows=1)
    slot = runner.row_state_slot(0)  # (models with linear attention: the row's recurrent state)
    logits = [runner.prefill(runner.row_pages(0), prompt, state_slot=slot)[0].float()]
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < steps:
        logits.append(runner.decode([runner.row_pages(0)], [tokens[-1]], [len(prompt) + len(tokens) - 1],
                                    None if slot is None else [slot])[0].float())
        tokens.append(int(logits[-1].argmax()))
    runner.close()
    del runner
    return tokens, logits


def hf_greedy(model_dir: Path, prompt: list[int], steps: int, device: str, dtype: str, experts: str) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), experts_implementation=experts
    ).to(device).eval()
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    del model
    return out[0, len(prompt):].tolist()


def compare(model_dir: Path, device: str, dtype: str, steps: int = 32, experts: str = "eager",
            moe_gemm: str = "torch", dense_kernels: str = "reference") -> dict:
    """Greedy tokens of ours against transformers'; `moe_gemm` / `dense_kernels` pick our path (the
    defaults mirror transformers' rounding points; "triton" / "fused" are the served kernels)."""
    raw = json.loads((model_dir / "config.json").read_text())
    vocab = raw.get("text_config", raw)["vocab_size"]  # (multimodal layouts nest the text model's config)
    prompt = torch.randint(0, min(vocab, 1000), (16,), generator=torch.Generator().manual_seed(11)).tolist()
    ours, logits = ours_greedy(model_dir, prompt, steps, device, dtype, moe_gemm, dense_kernels)
    theirs = hf_greedy(model_dir, prompt, steps, device, dtype, experts)
    agree = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), steps)
    report = {"steps": steps, "agree": agree, "ours": ours, "theirs": theirs, "experts_impl": experts}
    if agree < steps:  # how close the two candidates were in our logits where the paths split
        row = logits[agree]
        report["margin_at_divergence"] = float(row[ours[agree]] - row[theirs[agree]])
        report["logit_scale"] = float(row.abs().max())
    return report


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--archs", nargs="+", default=list(SUPPORTED_ARCHS), choices=SUPPORTED_ARCHS)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            for arch in args.archs:
                d = write_synthetic_checkpoint(Path(tmp) / f"{arch}-{preset}", arch, preset, seed=1, quiet=True)
                for experts in ("eager", "grouped_mm"):
                    t = time.perf_counter()
                    r = compare(d, args.device, args.dtype, args.steps, experts)
                    r.update(arch=arch, preset=preset, seconds=round(time.perf_counter() - t, 2))
                    results.append(r)
                    print(f"{arch:10s} {preset:6s} {experts:10s} agree {r['agree']}/{args.steps}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    Path(args.out).write_text(json.dumps({
        "command": "python -m benchmarks.parity " + " ".join(sys.argv[1:]),
        "machine": {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                    "cpu": platform.processor(), "torch": torch.__version__},
        "commit": commit,
        "results": results,
    }, indent=1))


if __name__ == "__main__":
    main()
