#!/usr/bin/env bash
# Hybrid's fill settings against transfer, both routings, one lease:
#   benchmarks/fill_variants_h200.sh OUT
# For each routing (own, replayed), one `bench decode` invocation runs transfer and hybrid at each
# copy-fill depth in DEPTHS (comma-separated, default 1,4,8), with and without --reroute-landing
# (REROUTE=both, the default; on or off for one), taking turns REPEATS times (default 3) and
# reporting each run's median repetition. Same model, cache and step counts as graphs_h200.sh;
# one JSON per routing in OUT.
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
        --modes graph --policies transfer,hybrid --reroute-landing "${REROUTE:-both}"
        --copy-fill-depth "${DEPTHS:-1,4,8}" --repeats "${REPEATS:-3}")
for routing in ${ROUTINGS:-own replayed}; do
  replay=()
  [ "$routing" = replayed ] && replay=(--routing-replay "$trace")
  timeout "${BENCH_TIMEOUT:-500}" python3 -m freetoken bench decode "${common[@]}" "${replay[@]}" \
      --out "$out/fill-variants-$routing.json" 2>&1 | grep -E 'median|Error' | sed "s/^/$routing /" || true
done
