#!/usr/bin/env bash
# The same-run race on one GGUF file: llama.cpp and freetoken at equal GPU weight memory.
#
#   LLAMA_BIN=DIR benchmarks/gguf_race.sh WORK OUT [LAYERS] [N_CPU_MOE]
#
# Writes WORK/q4-LAYERS.gguf (synth --gguf Q4_K_M of the qwen3-30b-a3b shape cut to LAYERS, default 16;
# kept if it is there) and the routing traces, measures this machine's Q4_K_M bandwidth profile and the
# quantized slot GEMM, computes the slot count whose GPU weight bytes equal llama.cpp's at
# --n-cpu-moe N_CPU_MOE (default 10), then runs llama-bench (DIR holds the prebuilt llama-bench: decode
# at N_CPU_MOE and with every expert layer on the CPU, prefill of 8192 tokens at -ub 4096) and ours
# (bench decode under OLMoE-calibrated and uniform routing, bench prefill of 8192 tokens). Results in
# OUT; each step's wall time in OUT/steps.txt. STEP_LIMIT (seconds, default 300) bounds every step.
set -uo pipefail
work=$1 out=$2 layers=${3:-16} ncm=${4:-10}
bin=${LLAMA_BIN:?set LLAMA_BIN to the folder holding llama-bench}
limit=${STEP_LIMIT:-300}
model="$work/q4-$layers.gguf"
mkdir -p "$work" "$out"
step() {  # NAME CMD...: run CMD under the step limit, log its wall time and exit status
  local name=$1 t0=$SECONDS rc
  shift
  timeout "$limit" "$@"
  rc=$?
  echo "$name rc=$rc $((SECONDS - t0)) s" | tee -a "$out/steps.txt"
}
[ -f "$model" ] || step synth python3 -m freetoken synth --arch qwen3_moe --preset qwen3-30b-a3b --layers "$layers" \
  --gguf Q4_K_M --out "$model"
for r in olmoe uniform; do
  [ -f "$work/$r-$layers.jsonl" ] || python3 -m freetoken sim-trace --preset $r --num-layers "$layers" --num-experts 128 \
    --top-k 8 --tokens 2048 --out "$work/$r-$layers.jsonl" > /dev/null
done
step gemm-probe python3 -m benchmarks.quant_gemm_probe --pairs Q4_K:Q6_K,Q4_K:Q4_K,Q6_K:Q6_K,Q8_0:Q8_0 \
  --out "$out/quant-gemm-probe.json"
step bw python3 -m freetoken bench bw --format Q4_K_M --out "$out/bw-profile-q4km.json"
step equal-memory python3 -m benchmarks.gguf_equal_memory --model "$model" --n-cpu-moe "$ncm" --out "$out/equal-memory.json"
slots=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['slots'])" "$out/equal-memory.json")
step "llama-decode-ncm$ncm" sh -c "'$bin/llama-bench' -m '$model' -ngl 99 --n-cpu-moe $ncm -t $(nproc) -r 2 -p 0 -n 48 \
  -o json > '$out/llamacpp-q4km-decode-ncpumoe$ncm.json'"
# every expert layer on the CPU: llama.cpp's --cpu-moe
step llama-decode-cpu-moe sh -c "'$bin/llama-bench' -m '$model' -ngl 99 --n-cpu-moe $layers -t $(nproc) -r 1 -p 0 -n 32 \
  -o json > '$out/llamacpp-q4km-decode-ncpumoe$layers.json'"
step llama-prefill sh -c "'$bin/llama-bench' -m '$model' -ngl 99 --n-cpu-moe $ncm -t $(nproc) -r 1 -p 8192 -ub 4096 -n 0 \
  -o json > '$out/llamacpp-q4km-prefill-ncpumoe$ncm.json'"
for r in olmoe uniform; do
  policies=transfer,hybrid
  [ $r = olmoe ] && policies=transfer,hybrid,cpu  # the cpu policy runs every expert on the CPU: routing does not matter
  step "decode-$r" sh -c "python3 -m freetoken bench decode --model '$model' --moe-cache-slots $slots \
    --bw-profile '$out/bw-profile-q4km.json' --policies $policies --modes graph --batch 1 --prompt-tokens 32 \
    --warmup-tokens 16 --decode-tokens 48 --routing-replay '$work/$r-$layers.jsonl' --out '$out/decode-q4km-$r.json' \
    > '$out/decode-q4km-$r.log' 2>&1"
  grep "tok/s" "$out/decode-q4km-$r.log"
done
step prefill python3 -m freetoken bench prefill --model "$model" --moe-policy hybrid --moe-cache-slots "$slots" \
  --lengths 8192 --bw-profile "$out/bw-profile-q4km.json" --out "$out/prefill-q4km.json"
