#!/usr/bin/env bash
# The llama.cpp baseline on the same model, at the placement whose GPU memory equals ours.
#
#   benchmarks/llamacpp_baseline.sh source DIR         fetch the llama-cpp-python sdist and keep only the
#                                                      llama.cpp tree it vendors, as DIR/llama.cpp.tar.gz
#                                                      (run where PyPI is reachable; the result travels)
#   benchmarks/llamacpp_baseline.sh run TARBALL MODEL OUT
#                                                      build llama-bench (CUDA when a GPU answers), export
#                                                      MODEL (a qwen3_moe checkpoint) to a GGUF of type
#                                                      GGUF_TYPE, run decode and prefill at every
#                                                      --n-cpu-moe in N_CPU_MOE
#   benchmarks/llamacpp_baseline.sh build TARBALL OUT  the build alone (into $WORK, kept for `bench`)
#   benchmarks/llamacpp_baseline.sh bench MODEL OUT    export and run with the build in $WORK
#
# Nothing is downloaded by `run`. Results: OUT/llamacpp-*.json (llama-bench's JSON) and the
# commands in OUT/llamacpp-commands.txt. Knobs: N_CPU_MOE (default 0 10 13 and every layer:
# on the 16-layer cut 10 and 13 keep 37.5% and 18.75% of the expert layers on the GPU),
# PREFILL, PREFILL_N_CPU_MOE (the settings prefill runs at), DECODE_TOKENS, REPS, THREADS, GGUF_TYPE
# (BF16, Q8_0, Q4_K_M, Q5_K_M or Q6_K; default BF16). MODEL may also be a .gguf file, served as is.
set -euo pipefail
cmd=$1
case "$cmd" in
source)
  dir=$2
  mkdir -p "$dir"
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python -d "$tmp"
  tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  src=$(ls -d "$tmp"/llama_cpp_python-*/vendor/llama.cpp)
  # keep what the build needs: sources, headers, CMake files
  tar -czf "$dir/llama.cpp.tar.gz" -C "$(dirname "$src")" \
      --exclude='llama.cpp/models' --exclude='llama.cpp/docs' --exclude='llama.cpp/media' \
      --exclude='llama.cpp/tests' --exclude='llama.cpp/examples' \
      --exclude='*.gguf' --exclude='llama.cpp/.git*' llama.cpp
  rm -rf "$tmp"
  ls -la "$dir/llama.cpp.tar.gz"
  ;;
build)
  tarball=$2 out=$3
  work=${WORK:-$HOME/llamacpp}
  mkdir -p "$work" "$out"
  tar -xzf "$tarball" -C "$work"
  cuda=OFF  # CUDA when a GPU answers (a compiler alone is not enough: the libraries come with the driver)
  nvidia-smi -L >/dev/null 2>&1 && cuda=ON
  # Flash attention off, as in the reference measurement: it builds several times faster, and
  # llama-bench's default (-fa 0) does not use it.
  cmake -S "$work/llama.cpp" -B "$work/build" -DGGML_CUDA=$cuda -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF \
      -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
      -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF > "$out/llamacpp-cmake.log"
  started=$(date +%s)
  cmake --build "$work/build" -j "$(nproc)" --target llama-bench > "$out/llamacpp-build.log"
  echo "llama-bench built in $(( $(date +%s) - started )) s (CUDA $cuda)"
  ;;
bench)
  model=$2 out=$3
  work=${WORK:-$HOME/llamacpp}
  mkdir -p "$out"
  bench="$work/build/bin/llama-bench"
  if [ -f "$model" ]; then
    gguf=$model
    layers=$(python3 -c "import gguf,sys; f=gguf.GGUFReader(sys.argv[1]).fields['qwen3moe.block_count']; print(int(f.parts[f.data[0]][0]))" "$gguf")
  else
    gguf="$work/model-${GGUF_TYPE:-BF16}.gguf"
    [ -f "$gguf" ] || python3 -m benchmarks.export_gguf --model "$model" --out "$gguf" --type "${GGUF_TYPE:-BF16}"
    layers=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['num_hidden_layers'])" "$model/config.json")
  fi
  : > "$out/llamacpp-commands.txt"
  for n in ${N_CPU_MOE:-0 10 13 $layers}; do
    for mode in decode prefill; do
      if [ "$mode" = decode ]; then
        shape=(-p 0 -n "${DECODE_TOKENS:-128}")
      else
        case " ${PREFILL_N_CPU_MOE:-10 13} " in *" $n "*) ;; *) continue ;; esac
        shape=(-p "${PREFILL:-512,2048,8192}" -n 0)
      fi
      args=(-m "$gguf" -ngl 99 --n-cpu-moe "$n" -t "${THREADS:-$(nproc)}" -r "${REPS:-3}" "${shape[@]}" -o json)
      echo "llama-bench ${args[*]}" >> "$out/llamacpp-commands.txt"
      "$bench" "${args[@]}" > "$out/llamacpp-$mode-ncpumoe$n.json"
      python3 -c "import json,sys; [print(sys.argv[2], r['n_prompt'], r['n_gen'], round(r['avg_ts'], 1), 'tok/s') for r in json.load(open(sys.argv[1]))]" \
          "$out/llamacpp-$mode-ncpumoe$n.json" "n-cpu-moe $n $mode" || true
    done
  done
  ;;
run)
  "$0" build "$2" "$4"
  "$0" bench "$3" "$4"
  ;;
*)
  sed -n 2,19p "$0"
  exit 2
  ;;
esac
