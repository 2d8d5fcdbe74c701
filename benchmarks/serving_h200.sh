#!/usr/bin/env bash
# Prefill and agentic-session measurements on a CUDA machine (well inside 10 minutes):
#   benchmarks/serving_h200.sh OUT
# tests/gpu on the current code; `bench prefill` at 2k/8k/32k tokens (hybrid, cache 37.5%);
# the agent session with and without prefix reuse, experts resident and offloaded (37.5%).
# Model goes to $WORK (default $HOME/ft-bench); PROFILE: a `bench bw` profile.
set -euo pipefail
out=$1
work=${WORK:-$HOME/ft-bench}
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1
profile=${PROFILE:-$work/bw_profiles.json}
model="$work/qwen3-30b-a3b-16l"
[ -f "$model/config.json" ] || python3 -m freetoken synth --arch qwen3_moe --preset qwen3-30b-a3b --layers 16 \
    --out "$model" 2>&1 | tail -2
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tail -25 | tee "$out/tests-gpu.txt"
fi
python3 -m freetoken bench prefill --model "$model" --lengths 2048,8192,32768 --moe-policy hybrid \
    --moe-cache-slots 768 --bw-profile "$profile" --out "$out/prefill-hybrid-768.json" 2>&1 | grep '^\[bench\]'
for policy in resident hybrid; do
  size=()
  [ "$policy" = hybrid ] && size=(--moe-cache-slots 768)
  python3 -m benchmarks.agent_session --model "$model" --device cuda --moe-policy "$policy" "${size[@]}" \
      --bw-profile "$profile" --turns 8 --tool-result-tokens "${RESULT_TOKENS:-2000}" --max-tokens 32 \
      --max-model-len 32768 --out "$out/agent-session-$policy.json" 2>&1 | grep '^turn'
done
