#!/usr/bin/env bash
# Hybrid's fill settings against transfer, both routings, one lease:
#   benchmarks/fill_variants_h200.sh OUT
# For each routing (own, replayed), one `bench decode` invocation runs transfer and hybrid at each
# copy-fill depth in DEPTHS (comma-separated, default 1,4,8), with and without --reroute-landing
# (REROUTE=both, the default; on or off for one), taking turns REPEATS times (default 3) and
# reporting each run's median repetition. Same model, cache and step counts as graphs_h200.sh;
# one JSON per routing in OUT.
set -euo pipefail
source "$(dirname "$0")/decode_setup.sh" "$1"
common=(--model "$model" --moe-cache-slots 768 --bw-profile "$profile" --prompt-tokens 32
        --warmup-tokens "${WARMUP_TOKENS:-16}" --decode-tokens "${DECODE_TOKENS:-48}" --batch "${BATCH:-1}"
        --modes graph --policies transfer,hybrid --reroute-landing "${REROUTE:-both}"
        --copy-fill-depth "${DEPTHS:-1,4,8}" --repeats "${REPEATS:-3}")
for routing in ${ROUTINGS:-own replayed}; do
  replay=()
  [ "$routing" = replayed ] && replay=(--routing-replay "$trace")
  timeout "${BENCH_TIMEOUT:-500}" python3 -m freetoken bench decode "${common[@]}" "${replay[@]}" \
      --out "$out/fill-variants-$routing.json" 2>&1 | grep -E 'median|Error' | sed "s/^/$routing /" || true
done
