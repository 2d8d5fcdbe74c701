"""`python -m freetoken bench prefill`: time to prefill long prompts, against the floor.

For each prompt length: one sequence's prompt is prefilled in chunks (`--prefill-chunk`),
each chunk streaming every MoE layer's experts through the slot cache's buffers. The floor
per chunk is the larger of (a) every expert crossing PCIe once, at the profile's bandwidth,
and (b) the chunk's matmul FLOPs at the device's measured bf16 rate; the prompt's floor is
the sum over its chunks. Reports tok/s and measured/floor.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from msgspec.structs import replace

from freetoken.bench.host_usage import checkpoint_bytes, peak_rss_bytes
from freetoken.bench.moe_params import add_moe_param_argument, for_policy, moe_config_fields
from freetoken.cli_args import add_engine_arguments, engine_config_from
from freetoken.progress import Progress

# the engine flags a prefill run takes as serve does
ENGINE_FLAGS = ("--device", "--moe-policy", "--moe-cache-slots", "--moe-cache-rate", "--bw-profile", "--prefill-chunk")


def add_bench_prefill_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory or GGUF file")
    # Resident (what auto picks when every expert fits) never streams a layer, which is what
    # this bench measures against its floor.
    add_engine_arguments(p, ENGINE_FLAGS, helps={"--moe-policy": "how cache misses are served (default: hybrid)"})
    p.set_defaults(moe_policy="hybrid")
    p.add_argument("--lengths", default="512,2048,8192,32768", help="prompt lengths, comma-separated")
    add_moe_param_argument(p)
    p.add_argument("--warmup-tokens", type=int, default=512,
                   help="an untimed prefill of this many tokens first (kernels compiled, libraries loaded); 0: none")
    p.add_argument("--trace", default=None, help="write a Perfetto timeline of the longest prompt here")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None, help="write tok/s per run, with measured/floor, as a PNG here")


def run_bench_prefill(args: argparse.Namespace) -> int:
    import torch

    from freetoken.engine.model_runner import ModelRunner
    from freetoken.moe.bandwidth_profile import load_ratio
    from freetoken.moe.profile_key import profile_key
    from freetoken.trace import NULL_RECORDER, TraceRecorder

    lengths = [int(x) for x in args.lengths.split(",")]
    device = engine_config_from(args, ENGINE_FLAGS).resolved_device()  # (--device auto: the config decides)
    try:
        moe_fields = moe_config_fields(args.moe_param)
    except ValueError as err:
        print(f"bench prefill: {err}", file=sys.stderr)
        return 2
    recorder = TraceRecorder() if args.trace else NULL_RECORDER
    base = engine_config_from(args, ENGINE_FLAGS)
    config = replace(base, model=args.model, device=device, max_model_len=max(lengths) + 1,
                     moe=replace(base.moe, **for_policy(base.moe.policy, moe_fields)))
    started = time.perf_counter()
    runner = ModelRunner(args.model, config, rows=1, recorder=recorder)
    load_s = time.perf_counter() - started
    cfg = runner.model_config
    if max(lengths) > runner.max_len:
        print(f"bench prefill: --lengths {max(lengths)} is longer than the model's context "
              f"({cfg.max_position_embeddings} positions)", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    pcie_bps, _, bw_source = load_ratio(args.bw_profile, gpu, profile_key(runner.pool.format))
    flops_rate = _matmul_rate(device, runner.dtype)
    pool_bytes = cfg.num_sparse_layers * cfg.num_experts * runner.pool.expert_bytes
    print(f"[bench] {runner.pool.format.name} experts, {runner.pool.expert_bytes / 1e6:.2f} MB each", file=sys.stderr)
    # parameters every prompt token multiplies by: the layers' dense weights and top-k experts (not
    # the embedding table it gathers a row from, nor the head, which runs for the chunk's last token)
    w = runner.weights
    active = ((w.step_read_bytes() - w.lm_head.nbytes) // w.embed.element_size()
              + cfg.num_sparse_layers * cfg.top_k * 3 * cfg.hidden_size * cfg.moe_intermediate_size)
    results = []
    if args.warmup_tokens:
        warm = min(args.warmup_tokens, max(lengths))
        runner.prefill(runner.row_pages(0), [t % cfg.vocab_size for t in range(warm)],
                       state_slot=runner.row_state_slot(0))
        _sync(device)
    with Progress("bench prefill", sum(lengths), unit="tokens") as progress:
        for n in lengths:
            draw = torch.Generator().manual_seed(n)
            prompt = torch.randint(0, min(cfg.vocab_size, 1000), (n,), generator=draw).tolist()
            pages = runner.row_pages(0)
            _sync(device)
            recorder.clear()
            t0 = time.perf_counter()
            for start in range(0, n, args.prefill_chunk):
                runner.prefill(pages, prompt[start : start + args.prefill_chunk], start=start,
                               state_slot=runner.row_state_slot(0))
            _sync(device)
            elapsed = time.perf_counter() - t0
            chunks = [min(args.prefill_chunk, n - s) for s in range(0, n, args.prefill_chunk)]
            floor = sum(max(pool_bytes / pcie_bps, 2 * active * c / flops_rate) for c in chunks)
            results.append({"prompt_tokens": n, "seconds": elapsed, "tok_per_s": n / elapsed, "floor_s": floor,
                            "measured_over_floor": elapsed / floor})
            progress.write(f"[bench] prefill {n:6d} tokens: {elapsed:7.2f} s, {n / elapsed:8.1f} tok/s, "
                           f"measured/floor {elapsed / floor:.2f}")
            progress.advance(n, f"prompt {n}")
    if args.trace:
        recorder.write_perfetto(args.trace)
    report = {"command": "python -m freetoken bench prefill " + " ".join(sys.argv[3:]),
              "machine": {"gpu": gpu}, "policy": runner.report.policy, "slots": runner.report.slots,
              "warmup_tokens": args.warmup_tokens,
              "expert_format": runner.pool.format.name, "expert_bytes": runner.pool.expert_bytes,
              "checkpoint_bytes": checkpoint_bytes(args.model),
              "host": {"engine_load_s": load_s, "peak_rss_bytes": peak_rss_bytes()},
              "bandwidths": {"pcie_Bps": pcie_bps, "source": bw_source, "matmul_flops": flops_rate},
              "results": results}
    runner.close()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        from freetoken.bench.plots import plot_prefill

        plot_prefill(report, args.plot)
    print(json.dumps(results, indent=1))
    return 0


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _matmul_rate(device: str, dtype) -> float:
    """FLOP/s of a large matmul in the compute dtype (the compute floor's rate)."""
    import torch

    n = 8192 if device == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    a @ a
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(5):
        a @ a
    _sync(device)
    return 5 * 2 * n**3 / (time.perf_counter() - t0)
