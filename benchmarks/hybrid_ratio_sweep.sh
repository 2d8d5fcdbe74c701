#!/usr/bin/env bash
# Hybrid's decode speed against its split ratio r (the PCIe share q* is given), both routings,
# with transfer as the reference in the same lease:  benchmarks/hybrid_ratio_sweep.sh OUT
# Same model, cache and step counts as graphs_h200.sh. RATIOS lists the r values (`profile`:
# the one the bandwidth profile gives); one JSON per (routing, r) in OUT. REPEATS (default 1):
# each invocation repeats its run that many times and reports the median (bench decode --repeats).
set -euo pipefail
out=$1
work=${WORK:-$HOME/ft-bench}
mkdir -p "$out" "$work"
profile=${PROFILE:-benchmarks/results/bw-profile-h200.json}
model="$work/qwen3-30b-a3b-16l"
[ -f "$model/config.json" ] || python3 -m freetoken synth --arch qwen3_moe --preset qwen3-30b-a3b --layers 16 \
    --out "$model" 2>&1 | tail -1
sync
trace="$work/olmoe-routing-16x128.jsonl"
[ -f "$trace" ] || python3 -m freetoken sim-trace --preset olmoe --num-layers 16 --num-experts 128 --top-k 8 \
    --tokens 2048 --out "$trace" > /dev/null
common=(--model "$model" --moe-cache-slots 768 --bw-profile "$profile" --prompt-tokens 32
        --warmup-tokens "${WARMUP_TOKENS:-16}" --decode-tokens "${DECODE_TOKENS:-48}" --batch "${BATCH:-1}"
        --modes graph --repeats "${REPEATS:-1}")
for routing in own replayed; do
  replay=()
  [ "$routing" = replayed ] && replay=(--routing-replay "$trace")
  timeout 200 python3 -m freetoken bench decode "${common[@]}" "${replay[@]}" --policies transfer \
      --out "$out/ratio-sweep-$routing-transfer.json" 2>&1 | grep -E '^\[bench\] transfer|Error' || true
  for r in ${RATIOS:-profile 0.55 0.65 0.75}; do
    ratio=()
    [ "$r" = profile ] || ratio=(--moe-ratio "$r")
    timeout 200 python3 -m freetoken bench decode "${common[@]}" "${replay[@]}" --policies hybrid "${ratio[@]}" \
        --out "$out/ratio-sweep-$routing-hybrid-r$r.json" 2>&1 | grep -E '^\[bench\] hybrid|Error' | sed "s/^/r=$r /" || true
  done
done
