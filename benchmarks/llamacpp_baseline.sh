#!/usr/bin/env bash
# The llama.cpp baseline on the same model, at the placement whose GPU memory equals ours.
#
#   benchmarks/llamacpp_baseline.sh source DIR         fetch the llama-cpp-python sdist and keep only the
#                                                      llama.cpp tree it vendors, as DIR/llama.cpp.tar.gz
#                                                      (run where PyPI is reachable; the result travels)
#   benchmarks/llamacpp_baseline.sh run TARBALL MODEL OUT
#                                                      build llama-bench (CUDA when nvcc is there), export
#                                                      MODEL (a qwen3_moe checkpoint) to bf16 GGUF, run
#                                                      decode and prefill at every --n-cpu-moe in N_CPU_MOE
#
# Nothing is downloaded by `run`. Results: OUT/llamacpp-*.json (llama-bench's JSON) and the
# commands in OUT/llamacpp-commands.txt.
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
run)
  tarball=$2 model=$3 out=$4
  work=${WORK:-$HOME/llamacpp}
  mkdir -p "$work" "$out"
  tar -xzf "$tarball" -C "$work"
  cuda=OFF  # CUDA when a GPU answers (a compiler alone is not enough: the libraries come with the driver)
  nvidia-smi -L >/dev/null 2>&1 && cuda=ON
  cmake -S "$work/llama.cpp" -B "$work/build" -DGGML_CUDA=$cuda -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
      -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF > "$out/llamacpp-cmake.log"
  cmake --build "$work/build" -j "$(nproc)" --target llama-bench > "$out/llamacpp-build.log"
  bench="$work/build/bin/llama-bench"
  gguf="$work/model.gguf"
  python3 -m benchmarks.export_gguf --model "$model" --out "$gguf"
  layers=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['num_hidden_layers'])" "$model/config.json")
  : > "$out/llamacpp-commands.txt"
  for n in ${N_CPU_MOE:-0 10 $layers}; do
    for mode in decode prefill; do
      if [ "$mode" = decode ]; then shape=(-p 0 -n "${DECODE_TOKENS:-128}"); else shape=(-p "${PREFILL:-512,2048,8192}" -n 0); fi
      args=(-m "$gguf" -ngl 99 --n-cpu-moe "$n" -t "${THREADS:-$(nproc)}" "${shape[@]}" -o json)
      echo "llama-bench ${args[*]}" >> "$out/llamacpp-commands.txt"
      "$bench" "${args[@]}" > "$out/llamacpp-$mode-ncpumoe$n.json"
    done
  done
  ;;
*)
  sed -n 2,14p "$0"
  exit 2
  ;;
esac
