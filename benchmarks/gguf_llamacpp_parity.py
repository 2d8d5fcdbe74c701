"""Does llama.cpp compute what freetoken computes on a GGUF of the same weights?

    python -m benchmarks.gguf_llamacpp_parity --model DIR --gguf FILE.gguf --greedy BIN \
        [--steps 32] [--prompt-len 24] [--seed 0] [--out RESULTS.json]

DIR is a synthetic safetensors checkpoint and FILE.gguf the same seed/preset/layers written by
`synth --gguf` (F32 for an exactness check); BIN is `benchmarks/llamacpp_greedy.c` built against
llama.cpp (its header says how). One prompt of random token ids goes to both: freetoken's fp32
engine on the CPU prefills it and decodes greedily; llama.cpp decodes greedily from the same ids
(no tokenizer in between). Printed and written: both token lists, whether they are equal, and per
step the largest logit difference relative to the largest logit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from freetoken.config import EngineConfig
from freetoken.engine.model_runner import ModelRunner
from freetoken.loader.presets import TOKENIZER_VOCAB


def freetoken_greedy(model_dir: str, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    engine = EngineConfig(device="cpu", dtype="float32", max_model_len=len(prompt) + steps + 8)
    runner = ModelRunner(model_dir, engine, rows=1)
    try:
        slot = runner.states.acquire() if runner.states is not None else None
        pages = runner.row_pages(0)
        logits = runner.prefill(pages, prompt, 0, state_slot=slot)[0]
        tokens, rows = [], []
        for step in range(steps):
            rows.append(logits.float())
            tokens.append(int(logits.argmax()))
            if step + 1 < steps:
                slots = None if slot is None else [slot]
                logits = runner.decode([pages], [tokens[-1]], [len(prompt) + step], slots)[0]
        return tokens, rows
    finally:
        runner.close()


def llamacpp_greedy(binary: str, gguf: str, prompt: list[int], steps: int, threads: int) -> dict:
    out = subprocess.run([binary, gguf, ",".join(map(str, prompt)), str(steps), str(threads)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--gguf", required=True)
    p.add_argument("--greedy", required=True, help="the built benchmarks/llamacpp_greedy.c")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="write the comparison as JSON here")
    args = p.parse_args()

    gen = torch.Generator().manual_seed(args.seed)
    # ids the synthetic tokenizer covers, above its special tokens' low ids
    prompt = torch.randint(16, TOKENIZER_VOCAB, (args.prompt_len,), generator=gen).tolist()
    ours, our_logits = freetoken_greedy(args.model, prompt, args.steps)
    theirs = llamacpp_greedy(args.greedy, args.gguf, prompt, args.steps, args.threads)
    rel = []
    for mine, other in zip(our_logits, theirs["logits"], strict=True):
        other_t = torch.tensor(other[: mine.numel()])
        rel.append(float((mine - other_t).abs().max() / other_t.abs().max()))
    first_diff = next((i for i, (a, b) in enumerate(zip(ours, theirs["token_ids"], strict=True)) if a != b), None)
    # the command with its files named by their base names (where they lay is this machine's affair)
    paths = {args.model, args.gguf, args.greedy, args.out}
    command = " ".join(Path(a).name if a in paths else a for a in sys.argv[1:])
    result = {
        "command": f"python -m benchmarks.gguf_llamacpp_parity {command}",
        "model": Path(args.model).name,
        "gguf": Path(args.gguf).name,
        "prompt_token_ids": prompt,
        "freetoken_fp32_cpu": ours,
        "llamacpp_cpu": theirs["token_ids"],
        "tokens_equal": ours == theirs["token_ids"],
        "first_different_step": first_diff,
        "max_rel_logit_diff_per_step": rel,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "max_rel_logit_diff_per_step"}))
    print(f"largest relative logit difference over {args.steps} steps: {max(rel):.3g}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["tokens_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
