#!/usr/bin/env bash
# Background fills against the work they overlap, on a CUDA machine:  benchmarks/fill_contention_h200.sh OUT
# benchmarks/fill_contention_probe.py alone (GEMM and CPU expert under each kind of fill), then
# `bench decode` (transfer and hybrid, graph mode, the 16-layer qwen3-30b-a3b cut at 768 slots)
# once per background-fill program count in PROGRAMS, under ROUTING (own or replayed).
set -euo pipefail
out=$1
work=${WORK:-$HOME/ft-bench}
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1
profile=${PROFILE:-benchmarks/results/bw-profile-h200.json}
model="$work/qwen3-30b-a3b-16l"
[ -f "$model/config.json" ] || python3 -m freetoken synth --arch qwen3_moe --preset qwen3-30b-a3b --layers 16 \
    --out "$model" 2>&1 | tail -1
sync  # the checkpoint's dirty pages written back now, not during the timed runs
replay=()
if [ "${ROUTING:-own}" = replayed ]; then
  python3 -m freetoken sim-trace --preset olmoe --num-layers 16 --num-experts 128 --top-k 8 --tokens 2048 \
      --out "$work/olmoe-routing-16x128.jsonl" > /dev/null
  replay=(--routing-replay "$work/olmoe-routing-16x128.jsonl")
fi
python3 -m benchmarks.fill_contention_probe --out "$out/fill-contention-${ROUTING:-own}.json" \
    --programs "${PROGRAMS:-16,32,64,128}" -- --model "$model" --moe-cache-slots 768 --bw-profile "$profile" \
    --prompt-tokens 32 --warmup-tokens 16 --decode-tokens 48 --batch 1 --policies "${POLICIES:-transfer,hybrid}" \
    --modes graph "${replay[@]}" 2>&1 | grep -E '^\[(probe|bench)\]|Error|error' || true
