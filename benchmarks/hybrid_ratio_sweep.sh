#!/usr/bin/env bash
# Hybrid's decode speed against its split ratio r (the PCIe share q* is given), both routings,
# with transfer as the reference in the same lease:  benchmarks/hybrid_ratio_sweep.sh OUT
# Same model, cache and step counts as graphs_h200.sh. RATIOS lists the r values (`profile`:
# the one the bandwidth profile gives); one JSON per (routing, r) in OUT. REPEATS (default 1):
# each invocation repeats its run that many times and reports the median (bench decode --repeats).
set -euo pipefail
source "$(dirname "$0")/decode_setup.sh" "$1"
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
    [ "$r" = profile ] || ratio=(--moe-param ratio="$r")
    timeout 200 python3 -m freetoken bench decode "${common[@]}" "${replay[@]}" --policies hybrid "${ratio[@]}" \
        --out "$out/ratio-sweep-$routing-hybrid-r$r.json" 2>&1 | grep -E '^\[bench\] hybrid|Error' | sed "s/^/r=$r /" || true
  done
done
