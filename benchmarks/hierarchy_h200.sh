#!/usr/bin/env bash
# The expert-hierarchy measurements on a CUDA machine, in two parts (each well inside 10 min).
#   benchmarks/hierarchy_h200.sh kernels OUT   tests/gpu, bench bw, the CPU kernel probe
#   benchmarks/hierarchy_h200.sh decode OUT    16-layer cut of qwen3-30b-a3b, every policy,
#                                              own routing and replayed realistic routing
# OUT receives the JSON results. Model and traces go to $WORK (default $HOME/ft-bench).
set -euo pipefail
part=$1
out=$2
work=${WORK:-$HOME/ft-bench}
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1
profile=${PROFILE:-$work/bw_profiles.json}
case "$part" in
kernels)
  python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tail -25 | tee "$out/tests-gpu.txt"
  python3 -m freetoken bench bw --out "$profile" --json > "$out/bw-profile.json"
  cp "$profile" "$out/bw_profiles.json"
  python3 -m benchmarks.cpu_experts_probe --out "$out/cpu-experts-probe.json" 2>&1 | tail -30
  ;;
decode)
  model="$work/qwen3-30b-a3b-16l"
  [ -f "$model/config.json" ] || python3 -m freetoken synth --arch qwen3_moe --preset qwen3-30b-a3b --layers 16 \
      --out "$model" 2>&1 | tail -2
  trace="$work/olmoe-routing-16x128.jsonl"
  python3 -m freetoken sim-trace --preset olmoe --num-layers 16 --num-experts 128 --top-k 8 --tokens 2048 \
      --out "$trace" --stats | tee "$out/replay-trace-stats.txt"
  common=(--model "$model" --moe-cache-slots 768 --bw-profile "$profile" --prompt-tokens 32
          --warmup-tokens "${WARMUP_TOKENS:-32}" --decode-tokens "${DECODE_TOKENS:-64}" --batch "${BATCH:-1}")
  python3 -m freetoken bench decode "${common[@]}" --out "$out/decode-own-routing.json" \
      --trace "$out/trace-hybrid-own.json" 2>&1 | grep '^\[bench\]'
  python3 -m freetoken bench decode "${common[@]}" --routing-replay "$trace" \
      --out "$out/decode-replayed-routing.json" 2>&1 | grep '^\[bench\]'
  ;;
esac
# hybrid with the CPU routes computed inline (after queuing the GPU work) instead of on the worker
if [ "$part" = decode ]; then
  python3 -m freetoken bench decode "${common[@]}" --routing-replay "$trace" --policies hybrid --moe-param cpu_branch=inline \
      --out "$out/decode-replayed-routing-hybrid-inline.json" 2>&1 | grep '^\[bench\]'
fi
