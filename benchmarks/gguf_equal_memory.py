"""The expert-cache size that gives us the GPU weight memory llama.cpp uses on the same GGUF file.

    python -m benchmarks.gguf_equal_memory --model FILE.gguf --n-cpu-moe 10 [--out F.json]

llama.cpp at `-ngl 99 --n-cpu-moe N` keeps every tensor on the GPU in the file's own types except
the expert tensors (`*_exps`) of the first N layers and the token embedding table (its input layer
stays in host memory). We keep the dense tensors dequantized to bf16, the token embedding table in
host memory too (unless the head is tied to it: then both engines hold it on the GPU), and the
experts as blocks in slots of the pool's widest layer; so at equal weight memory our slots are
(llama.cpp's GPU bytes - our dense bytes) / our slot bytes. Prints the figures as JSON.
(KV caches are not counted on either side: both are small at the benchmark's context lengths.)
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from freetoken.config import ModelConfig
from freetoken.loader.gguf_file import GgufFile
from freetoken.loader.gguf_reader import GgufTensorReader
from freetoken.moe.block_format import block_format_for

EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")


def equal_memory(model: Path, n_cpu_moe: int) -> dict:
    gguf = GgufFile(model)
    cfg = ModelConfig.from_checkpoint(model)
    llama_gpu = ours_dense = 0
    untied = "output.weight" in gguf.tensor_names
    for name in gguf.tensor_names:
        entry = gguf.entry(name)
        expert = EXPERT_TENSOR.fullmatch(name)
        if name == "token_embd.weight" and untied:
            continue  # in host memory on both sides
        if expert is None:
            llama_gpu += entry.raw.nbytes
            elements = 1
            for d in entry.shape:
                elements *= d
            ours_dense += 2 * elements  # dequantized to bf16
        elif int(expert.group(1)) >= n_cpu_moe:
            llama_gpu += entry.raw.nbytes
    fmt = block_format_for(GgufTensorReader(gguf).gguf, cfg)
    slot_bytes = fmt.expert_bytes(cfg)
    slots = (llama_gpu - ours_dense) // slot_bytes
    if slots < 1:
        raise SystemExit(f"{model}: llama.cpp's {llama_gpu} GPU bytes at --n-cpu-moe {n_cpu_moe} do not cover our "
                         f"{ours_dense} bytes of bf16 dense weights: no slot fits")
    return {"model": str(model), "n_cpu_moe": n_cpu_moe, "llama_gpu_weight_bytes": llama_gpu,
            "our_dense_bytes": ours_dense, "slot_bytes": slot_bytes, "slots": int(slots),
            "pool_experts": cfg.num_sparse_layers * cfg.num_experts,
            "llama_gpu_expert_layers": cfg.num_layers - n_cpu_moe}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--n-cpu-moe", type=int, required=True)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    result = equal_memory(args.model, args.n_cpu_moe)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
