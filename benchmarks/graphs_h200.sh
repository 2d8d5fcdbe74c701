#!/usr/bin/env bash
# Decode in CUDA graphs against eager on a CUDA machine (well inside 10 minutes):
#   benchmarks/graphs_h200.sh OUT
# tests/gpu for graphs (and the parity/engine tests they touch); then `bench decode` on a
# 16-layer cut of qwen3-30b-a3b, cache 768 slots (37.5% of the pool), batch 1, every policy
# in graph and eager mode, under the checkpoint's own routing and under replayed realistic
# routing; a Perfetto trace of each policy in graph mode (device layer phases included) and
# their summary (benchmarks/graph_step_timeline.py). Model and routing trace go to $WORK.
set -euo pipefail
out=$1
work=${WORK:-$HOME/ft-bench}
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1
profile=${PROFILE:-$work/bw_profiles.json}
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-180}" python3 -m pytest ${TESTS:-tests/gpu/test_decode_graphs_cuda.py tests/gpu/test_engine_cuda.py} \
      -p no:cacheprovider 2>&1 | tail -${TEST_LINES:-30} | tee "$out/tests-gpu-graphs.txt" || true
fi
model="$work/qwen3-30b-a3b-16l"
[ -f "$model/config.json" ] || python3 -m freetoken synth --arch qwen3_moe --preset qwen3-30b-a3b --layers 16 \
    --out "$model" 2>&1 | tail -1
sync  # the checkpoint's dirty pages written back now, not during the first timed runs
trace="$work/olmoe-routing-16x128.jsonl"
python3 -m freetoken sim-trace --preset olmoe --num-layers 16 --num-experts 128 --top-k 8 --tokens 2048 \
    --out "$trace" > /dev/null
common=(--model "$model" --moe-cache-slots 768 --bw-profile "$profile" --prompt-tokens 32
        --warmup-tokens "${WARMUP_TOKENS:-16}" --decode-tokens "${DECODE_TOKENS:-48}" --batch "${BATCH:-1}"
        --policies "${POLICIES:-resident,transfer,cpu,static,hybrid}" --modes "${MODES:-graph,eager}"
        --moe-param fetch_recurring="${FETCH_RECURRING:-on}" --moe-param background_fills="${BACKGROUND_FILLS:-on}"
        --repeats "${REPEATS:-1}")  # (REPEATS > 1 needs TRACE=0)
# TRACE=0: no timelines. Tracing stamps each layer's phases on the device and reads them back
# after every step, so a traced run's tok/s is not a speed figure (its device step times are).
own_trace=() replayed_trace=()
if [ "${TRACE:-1}" = 1 ] && [ "${REPEATS:-1}" = 1 ]; then  # (a trace records one run: none with REPEATS)
  own_trace=(--trace "$out/trace-graph-own.json") replayed_trace=(--trace "$out/trace-graph-replayed.json")
fi
timeout "${BENCH_TIMEOUT:-200}" python3 -m freetoken bench decode "${common[@]}" --out "$out/decode-graphs-own-routing.json" \
    "${own_trace[@]}" 2>&1 | grep -E '^\[bench\]|Error|error' || true
timeout "${BENCH_TIMEOUT:-200}" python3 -m freetoken bench decode "${common[@]}" --routing-replay "$trace" \
    --out "$out/decode-graphs-replayed-routing.json" "${replayed_trace[@]}" 2>&1 \
    | grep -E '^\[bench\]|Error|error' || true
for routing in own replayed; do
  labels=()
  for t in "$out"/trace-graph-"$routing"*.json; do
    [ -f "$t" ] || continue
    name=$(basename "$t" .json); name=${name#trace-graph-"$routing"}; labels+=("${name#-}=$t")
  done
  [ ${#labels[@]} -gt 0 ] && python3 benchmarks/graph_step_timeline.py "${labels[@]}" \
      --out "$out/graph-step-timeline-$routing.json" | grep -vE '^  ' || true
done
