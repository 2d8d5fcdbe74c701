# Sourced by the decode benchmark scripts: makes OUT and WORK, then the 16-layer cut of
# qwen3-30b-a3b and the OLMoE-calibrated routing trace in WORK unless they are there already.
# Sets: out, work, profile, model, trace.
out=$1
work=${WORK:-$HOME/ft-bench}
mkdir -p "$out" "$work"
profile=${PROFILE:-benchmarks/results/bw-profile-h200.json}
model="$work/qwen3-30b-a3b-16l"
[ -f "$model/config.json" ] || python3 -m freetoken synth --arch qwen3_moe --preset qwen3-30b-a3b --layers 16 \
    --out "$model" 2>&1 | tail -1
sync  # the checkpoint's dirty pages written back now, not during the first timed runs
trace="$work/olmoe-routing-16x128.jsonl"
[ -f "$trace" ] || python3 -m freetoken sim-trace --preset olmoe --num-layers 16 --num-experts 128 --top-k 8 \
    --tokens 2048 --out "$trace" > /dev/null
