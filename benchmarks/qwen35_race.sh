#!/usr/bin/env bash
# Issue 31's race: freetoken (bf16 safetensors) against llama.cpp (a qwen35moe GGUF of the same
# weights) on the hybrid Qwen3.6 shape, in one run, at equal GPU expert memory.
#
#   benchmarks/qwen35_race.sh MODEL_DIR MODEL.gguf LLAMA_BIN OUT [N_CPU_MOE]
#
# MODEL_DIR and MODEL.gguf come from the same synth call but for --gguf, e.g.
#   python -m freetoken synth --arch qwen3_5_moe --preset qwen3.6-35b-a3b --layers 12 --out MODEL_DIR
#   python -m freetoken synth --arch qwen3_5_moe --preset qwen3.6-35b-a3b --layers 12 --gguf BF16 --out MODEL.gguf
# LLAMA_BIN holds a llama-bench built with CUDA. llama.cpp runs at -ngl 99 --n-cpu-moe N_CPU_MOE
# (default: the layer count that leaves the nearest share to 37.5% of the expert layers on the GPU);
# freetoken's expert cache gets the same number of experts, (layers - N_CPU_MOE) * experts slots
# (both store the experts in bf16, and both keep every dense tensor on the GPU). Results in OUT:
# llama-bench's JSON, bench decode under OLMoE-calibrated and uniform routing, bench prefill at 8k,
# the commands in OUT/commands.txt. MODES (default eager: decode graphs do not cover the
# linear-attention layers yet, the engine would run them eager) sets bench decode's --modes.
set -euo pipefail
model=$1 gguf=$2 bin=$3 out=$4
mkdir -p "$out"
read -r layers experts top_k hidden inter < <(python3 -c "
import json, sys
c = json.load(open(sys.argv[1] + '/config.json'))
c = c.get('text_config', c)
print(c['num_hidden_layers'], c['num_experts'], c['num_experts_per_tok'], c['hidden_size'], c['moe_intermediate_size'])" "$model")
ncm=${5:-$(python3 -c "import sys; n=int(sys.argv[1]); print(min(range(n + 1), key=lambda k: abs((n - k) / n - 0.375)))" "$layers")}
slots=$(( (layers - ncm) * experts ))
export NUMBA_CACHE_DIR=$(mktemp -d)  # a fresh Numba cache per run (see the GPU machine notes)
log() { echo "$*" >> "$out/commands.txt"; "$@"; }
: > "$out/commands.txt"
echo "layers $layers, experts $experts, top-k $top_k: llama.cpp --n-cpu-moe $ncm, freetoken $slots slots" | tee "$out/setting.txt"
for r in olmoe uniform; do
  log python3 -m freetoken sim-trace --preset $r --num-layers "$layers" --num-experts "$experts" --top-k "$top_k" \
    --tokens 2048 --out "$out/routing-$r.jsonl"
done
log python3 -m freetoken bench bw --format bf16 --hidden "$hidden" --intermediate "$inter" --top-k "$top_k" \
  --experts "$experts" --out "$out/bw-profile.json"
log "$bin/llama-bench" -m "$gguf" -ngl 99 --n-cpu-moe "$ncm" -t "$(nproc)" -r 2 -p 0 -n 64 -o json \
  > "$out/llamacpp-decode-ncpumoe$ncm.json"
log "$bin/llama-bench" -m "$gguf" -ngl 99 --n-cpu-moe "$ncm" -t "$(nproc)" -r 1 -p 8192 -b 8192 -ub 4096 -n 0 -o json \
  > "$out/llamacpp-prefill8k-ncpumoe$ncm.json"
for r in olmoe uniform; do
  log python3 -m freetoken bench decode --model "$model" --moe-cache-slots "$slots" --bw-profile "$out/bw-profile.json" \
    --policies transfer,hybrid,cpu --modes "${MODES:-eager}" --batch 1 --prompt-tokens 32 --warmup-tokens 16 --decode-tokens 64 \
    --routing-replay "$out/routing-$r.jsonl" --out "$out/decode-$r.json" 2>&1 | tee "$out/decode-$r.log"
done
log python3 -m freetoken bench prefill --model "$model" --moe-cache-slots "$slots" --lengths 8192 \
  --bw-profile "$out/bw-profile.json" --out "$out/prefill-8k.json"
python3 - "$out" "$ncm" <<'EOF'
import json, sys
out, ncm = sys.argv[1], sys.argv[2]
for name in (f"llamacpp-decode-ncpumoe{ncm}.json", f"llamacpp-prefill8k-ncpumoe{ncm}.json"):
    for r in json.load(open(f"{out}/{name}")):
        print(f"llama.cpp --n-cpu-moe {ncm}: pp{r['n_prompt']} tg{r['n_gen']} {r['avg_ts']:.1f} tok/s")
EOF
