#!/usr/bin/env bash
# The same-run race on one GGUF file: llama.cpp and freetoken at equal GPU weight memory.
#
#   LLAMA_BIN=DIR benchmarks/gguf_race.sh WORK OUT [LAYERS] [N_CPU_MOE]
#
# Writes WORK/q4.gguf (synth --gguf Q4_K_M of the qwen3-30b-a3b shape cut to LAYERS, default 16) and the
# routing traces, measures this machine's Q4_K_M bandwidth profile, computes the slot count whose GPU
# weight bytes equal llama.cpp's at --n-cpu-moe N_CPU_MOE (default 10), then runs llama-bench (DIR holds
# the prebuilt llama-bench) and bench decode under OLMoE-calibrated and uniform routing. Results in OUT.
set -euo pipefail
work=$1 out=$2 layers=${3:-16} ncm=${4:-10}
bin=${LLAMA_BIN:?set LLAMA_BIN to the folder holding llama-bench}
mkdir -p "$work" "$out"
python3 -m freetoken synth --arch qwen3_moe --preset qwen3-30b-a3b --layers "$layers" --gguf Q4_K_M --out "$work/q4.gguf"
for r in olmoe uniform; do
  python3 -m freetoken sim-trace --preset $r --num-layers "$layers" --num-experts 128 --top-k 8 --tokens 2048 --out "$work/$r.jsonl"
done
python3 -m benchmarks.quant_gemm_probe --pairs Q4_K:Q6_K,Q4_K:Q4_K,Q6_K:Q6_K,Q8_0:Q8_0 --out "$out/quant-gemm-probe.json"
python3 -m freetoken bench bw --format Q4_K_M --out "$out/bw-profile-q4km.json"
python3 -m benchmarks.gguf_equal_memory --model "$work/q4.gguf" --n-cpu-moe "$ncm" --out "$out/equal-memory.json"
slots=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['slots'])" "$out/equal-memory.json")
for n in "$ncm" "$layers"; do  # (all layers' experts on the CPU: llama.cpp's --cpu-moe)
  "$bin/llama-bench" -m "$work/q4.gguf" -ngl 99 --n-cpu-moe "$n" -t "$(nproc)" -r 2 -p 0 -n 48 -o json > "$out/llamacpp-q4km-decode-ncpumoe$n.json"
done
"$bin/llama-bench" -m "$work/q4.gguf" -ngl 99 --n-cpu-moe "$ncm" -t "$(nproc)" -r 1 -p 8192 -ub 4096 -n 0 -o json > "$out/llamacpp-q4km-prefill-ncpumoe$ncm.json"
for r in olmoe uniform; do
  python3 -m freetoken bench decode --model "$work/q4.gguf" --moe-cache-slots "$slots" --bw-profile "$out/bw-profile-q4km.json" \
    --policies transfer,hybrid,cpu --modes graph --batch 1 --prompt-tokens 32 --warmup-tokens 16 --decode-tokens 48 \
    --routing-replay "$work/$r.jsonl" --out "$out/decode-q4km-$r.json" 2>&1 | tee "$out/decode-q4km-$r.log"
done
python3 -m freetoken bench prefill --model "$work/q4.gguf" --moe-cache-slots "$slots" --lengths 8192 \
  --bw-profile "$out/bw-profile-q4km.json" --out "$out/prefill-q4km.json"
