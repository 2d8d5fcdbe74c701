"""MXFP4 dequantization of one prefill group on the GPU: `dequantize_mxfp4`'s torch ops against
the Triton kernel (kernels/triton/mxfp4_dequant.py) that `ProjectionRows.dequantize` takes on CUDA.

    python -m benchmarks.mxfp4_dequant_probe [--experts N] [--dtype bf16] [--sweep] [--out FILE.json]

Defaults are gpt-oss-120b's expert shape (H 2880, I 2880: gate_up blocks [2I, H/32, 16], down
[H, I/32, 16]) and the group a long prefill chunk dequantizes at once (moe/mxfp4_format.py:
PREFILL_GROUP_BYTES over one expert's bf16 bytes, 21 experts). The banks are random bytes in the
format's layout (scale bytes 118..127, as real weights take) and each projection is handed over as
`ProjectionRows.unpack` hands it (views of the slots' byte rows). Each variant is timed with CUDA
events, the median of --runs calls after --warmup; its rate is bytes read (codes and scales) plus
bytes written (the values), over that time. The Triton outputs are compared with the torch ones
bit for bit, and each variant's peak of memory allocated beyond its inputs is printed. Every other
slot of the group is then dequantized as the format's prefill asks for routed slots: the bank's rows
gathered first, then the kernel, against the kernel reading them in place by their indices.
--sweep also tries other groups per program and warps of the kernel. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import torch

from benchmarks.cuda_timing import median_event_ms

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SWEEP = [(bg, w) for bg in (64, 128, 256, 512) for w in (2, 4, 8)]  # (block_groups, warps)


def _peak_bytes(fn) -> int:
    """Bytes fn allocates at its peak beyond what was allocated before it ran."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def _group(fmt, experts: int):
    """Random banks of `experts` slots in the format's layout, on the device; per projection its
    (name, blocks, scales) views as `unpack` gives them."""
    g = torch.Generator(device="cuda").manual_seed(0)
    views = []
    for name, proj, spec in zip(("gate_up", "down"), (fmt.gate_up, fmt.down), fmt.banks(None), strict=True):
        bank = torch.randint(0, 256, (experts, *spec.row_shape), generator=g, device="cuda", dtype=torch.uint8)
        bank[:, proj.scales_at : proj.bias_at] = torch.randint(
            118, 128, (experts, proj.bias_at - proj.scales_at), generator=g, device="cuda", dtype=torch.uint8)
        blocks, scales, _ = proj.unpack(bank, fmt.bias_dtype)
        views.append((name, blocks, scales, proj, bank))
    return views


def _gathered(proj, bank, picked, bias_dtype, dtype):
    """The routed slots' rows copied out of the bank, then dequantized: what the format did before."""
    from freetoken.kernels.triton.mxfp4_dequant import dequantize_mxfp4_triton

    return dequantize_mxfp4_triton(*proj.unpack(bank[picked], bias_dtype)[:2], dtype)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--inter", type=int, default=2880)
    p.add_argument("--experts", type=int, default=None, help="slots in the group (default: PREFILL_GROUP_BYTES's)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sweep", action="store_true", help="also try other groups per program and warps")
    p.add_argument("--out", default=None, help="write the rows as JSON")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("mxfp4_dequant_probe times CUDA kernels and needs a CUDA device; none is available")
    from freetoken.kernels.triton.mxfp4_dequant import BLOCK_GROUPS, WARPS, dequantize_mxfp4_triton
    from freetoken.moe.mxfp4_format import PREFILL_GROUP_BYTES, Mxfp4ExpertFormat
    from freetoken.quant.mxfp4 import dequantize_mxfp4

    H, inter, dtype = args.hidden, args.inter, DTYPES[args.dtype]
    fmt = Mxfp4ExpertFormat(H, inter, torch.bfloat16)
    experts = args.experts or max(1, PREFILL_GROUP_BYTES // (3 * H * inter * torch.bfloat16.itemsize))
    views = _group(fmt, experts)
    size = torch.tensor([], dtype=dtype).element_size()
    rows, totals = [], {}

    def record(kernel: str, name: str, blocks, scales, fn, **extra) -> dict:
        ms = median_event_ms(fn, args.runs, args.warmup)
        moved = blocks.numel() + scales.numel() + scales.numel() * 32 * size
        row = dict(kernel=kernel, projection=name, ms=ms, GBps=moved / ms / 1e6, bytes_moved=moved, **extra)
        rows.append(row)
        return row

    for name, blocks, scales, proj, bank in views:
        want = dequantize_mxfp4(blocks, scales, dtype)
        got = dequantize_mxfp4_triton(blocks, scales, dtype)
        exact = bool(torch.equal(got.view(torch.int16 if size == 2 else torch.int32),
                                 want.view(torch.int16 if size == 2 else torch.int32)))
        del want, got
        shape = f"{tuple(blocks.shape)} -> {args.dtype}"
        for kernel, fn in (("torch ops (dequantize_mxfp4)", partial(dequantize_mxfp4, blocks, scales, dtype)),
                           (f"triton ({BLOCK_GROUPS} groups, {WARPS} warps)",
                            partial(dequantize_mxfp4_triton, blocks, scales, dtype))):
            peak = _peak_bytes(fn)
            row = record(kernel, name, blocks, scales, fn, peak_bytes=peak, bit_exact=exact)
            totals[kernel] = totals.get(kernel, 0.0) + row["ms"]
            print(f"{name} {shape}, {kernel}: {row['ms']:.3f} ms, {row['GBps']:.0f} GB/s, "
                  f"peak {peak / 1e9:.2f} GB", flush=True)
        print(f"  {name}: Triton output equal to the torch ops' bit for bit: {exact}", flush=True)
        # a prefill group's slots as the format asks for them: every other slot, gathered then
        # dequantized (the bank's rows copied first) against read in place by their indices
        picked = torch.arange(0, blocks.shape[0], 2, device="cuda")
        for kernel, fn in (("gathered, then triton", partial(_gathered, proj, bank, picked, fmt.bias_dtype, dtype)),
                           ("picked in place (format.dequantize)",
                            partial(proj.dequantize, bank, picked, fmt.bias_dtype, dtype))):
            row = record(kernel, name, blocks[picked], scales[picked], fn, picked=len(picked))
            print(f"    {len(picked)} picked slots, {kernel}: {row['ms']:.3f} ms, {row['GBps']:.0f} GB/s", flush=True)
        if args.sweep:
            tried = [record("triton sweep", name, blocks, scales,
                            partial(dequantize_mxfp4_triton, blocks, scales, dtype, block_groups=bg, warps=w),
                            block_groups=bg, warps=w) for bg, w in SWEEP]
            for r in tried:
                print(f"    {r['block_groups']} groups, {r['warps']} warps: {r['ms']:.3f} ms, {r['GBps']:.0f} GB/s")
            best = min(tried, key=lambda r: r["ms"])
            print(f"  sweep best: {best['block_groups']} groups, {best['warps']} warps, {best['ms']:.3f} ms",
                  flush=True)
    torch_ms, triton_ms = (totals[k] for k in list(totals)[:2])
    print(f"group of {experts} experts, both projections: torch ops {torch_ms:.2f} ms, Triton {triton_ms:.2f} ms "
          f"({torch_ms / triton_ms:.1f}x)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), hidden=H, inter=inter, experts=experts, dtype=args.dtype,
                           runs=args.runs, warmup=args.warmup, totals_ms=totals, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
