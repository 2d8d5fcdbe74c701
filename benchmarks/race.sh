#!/usr/bin/env bash
# A safetensors checkpoint's race: freetoken against llama.cpp (a GGUF of the same weights), in
# one run, at equal GPU expert memory (issue 31: the hybrid Qwen3.6 shape in bf16; issue 32: the
# gpt-oss-120b shape in MXFP4).
#
#   benchmarks/race.sh MODEL_DIR MODEL.gguf LLAMA_BIN OUT [N_CPU_MOE]
#
# MODEL_DIR and MODEL.gguf come from the same synth call but for --gguf, e.g.
#   python -m freetoken synth --arch qwen3_5_moe --preset qwen3.6-35b-a3b --layers 12 --out MODEL_DIR
#   python -m freetoken synth --arch qwen3_5_moe --preset qwen3.6-35b-a3b --layers 12 --gguf BF16 --out MODEL.gguf
#   python -m freetoken synth --arch gpt_oss --preset gpt-oss-120b --layers 12 --mxfp4 --out MODEL_DIR
#   python -m freetoken synth --arch gpt_oss --preset gpt-oss-120b --layers 12 --gguf MXFP4 --out MODEL.gguf
# LLAMA_BIN holds a llama-bench built with CUDA. llama.cpp runs at -ngl 99 --n-cpu-moe N_CPU_MOE
# (default: the layer count that leaves the nearest share to 37.5% of the expert layers on the GPU);
# freetoken's expert cache gets the same number of experts, (layers - N_CPU_MOE) * experts slots
# (both store the experts in the same format, bf16 or MXFP4, and both keep every dense tensor on the
# GPU but the token embedding table, which both keep in host memory). Results in OUT: llama-bench's JSON (decode at N_CPU_MOE and with every expert layer on the
# CPU, prefill of 8192 tokens at -ub 4096), bench decode under OLMoE-calibrated and uniform routing,
# bench prefill at 8k, the commands in OUT/commands.txt. MODES (default graph) sets bench decode's --modes,
# POLICIES (default transfer,hybrid,cpu) its --policies; DECODE_ONLY=1 runs only the decode race at
# N_CPU_MOE (no all-CPU llama.cpp run, no prefill) when device time is short; BW_PROFILE=FILE takes
# a bandwidth profile measured earlier instead of running bench bw.
set -euo pipefail
model=$1 gguf=$2 bin=$3 out=$4
mkdir -p "$out"
read -r layers experts top_k hidden inter format < <(python3 -c "
import json, sys
c = json.load(open(sys.argv[1] + '/config.json'))
c = c.get('text_config', c)
experts = c.get('num_experts', c.get('num_local_experts'))
inter = c.get('moe_intermediate_size') or c['intermediate_size']
mxfp4 = (c.get('quantization_config') or {}).get('quant_method') == 'mxfp4'
print(c['num_hidden_layers'], experts, c['num_experts_per_tok'], c['hidden_size'], inter, 'mxfp4+bias' if mxfp4 else 'bf16')" "$model")
ncm=${5:-$(python3 -c "import sys; n=int(sys.argv[1]); print(min(range(n + 1), key=lambda k: abs((n - k) / n - 0.375)))" "$layers")}
slots=$(( (layers - ncm) * experts ))
export NUMBA_CACHE_DIR=$(mktemp -d)  # a fresh Numba cache per run (see the GPU machine notes)
log() { echo "$*" >> "$out/commands.txt"; "$@"; }
: > "$out/commands.txt"
echo "layers $layers, experts $experts, top-k $top_k, $format: llama.cpp --n-cpu-moe $ncm, freetoken $slots slots" | tee "$out/setting.txt"
for r in olmoe uniform; do
  log python3 -m freetoken sim-trace --preset $r --num-layers "$layers" --num-experts "$experts" --top-k "$top_k" \
    --tokens 2048 --out "$out/routing-$r.jsonl"
done
if [ -n "${BW_PROFILE:-}" ]; then  # a profile measured earlier on this machine type
  cp "$BW_PROFILE" "$out/bw-profile.json"
else
  log python3 -m freetoken bench bw --format "$format" --hidden "$hidden" --intermediate "$inter" --top-k "$top_k" \
    --experts "$experts" --out "$out/bw-profile.json"
fi
log "$bin/llama-bench" -m "$gguf" -ngl 99 --n-cpu-moe "$ncm" -t "$(nproc)" -r 2 -p 0 -n 64 -o json \
  > "$out/llamacpp-decode-ncpumoe$ncm.json"
if [ "${DECODE_ONLY:-0}" != 1 ]; then
  log "$bin/llama-bench" -m "$gguf" -ngl 99 --n-cpu-moe "$layers" -t "$(nproc)" -r 2 -p 0 -n 64 -o json \
    > "$out/llamacpp-decode-ncpumoe$layers.json"
  log "$bin/llama-bench" -m "$gguf" -ngl 99 --n-cpu-moe "$ncm" -t "$(nproc)" -r 1 -p 8192 -b 8192 -ub 4096 -n 0 -o json \
    > "$out/llamacpp-prefill8k-ncpumoe$ncm.json"
fi
for r in olmoe uniform; do
  log python3 -m freetoken bench decode --model "$model" --moe-cache-slots "$slots" --bw-profile "$out/bw-profile.json" \
    --policies "${POLICIES:-transfer,hybrid,cpu}" --modes "${MODES:-graph}" --batch 1 --prompt-tokens 32 --warmup-tokens 16 --decode-tokens 64 \
    --routing-replay "$out/routing-$r.jsonl" --out "$out/decode-$r.json" 2>&1 | tee "$out/decode-$r.log"
done
if [ "${DECODE_ONLY:-0}" != 1 ]; then
  log python3 -m freetoken bench prefill --model "$model" --moe-cache-slots "$slots" --lengths 8192 \
    --bw-profile "$out/bw-profile.json" --out "$out/prefill-8k.json"
fi
python3 - "$out" <<'EOF'
import json, os, sys
out = sys.argv[1]
for name in sorted(n for n in os.listdir(out) if n.startswith("llamacpp-")):
    for r in json.load(open(f"{out}/{name}")):
        ncm = name.rsplit("ncpumoe", 1)[1].removesuffix(".json")
        print(f"llama.cpp --n-cpu-moe {ncm}: pp{r['n_prompt']} tg{r['n_gen']} {r['avg_ts']:.1f} tok/s")
EOF
