#!/usr/bin/env bash
# Every policy (hybrid with and without background fills) in graph mode under both routings,
# then tests/gpu: one lease, one model.  benchmarks/run_policies_h200.sh OUT
set -uo pipefail
out=$1
root=$PWD
export WORK=${WORK:-/tmp/ftb} SKIP_TESTS=1 MODES=graph TRACE=${TRACE:-0} BENCH_TIMEOUT=${BENCH_TIMEOUT:-200}
export PROFILE=${PROFILE:-$root/benchmarks/results/bw-profile-h200.json}
export POLICIES=${POLICIES:-resident,transfer,cpu,static,hybrid}
nvidia-smi --query-gpu=name --format=csv,noheader
bash benchmarks/graphs_h200.sh "$out"
[ "${SKIP_GPU_TESTS:-0}" = 1 ] || timeout "${TEST_BUDGET:-240}" python3 -m pytest ${GPU_TESTS:-tests/gpu} \
    -p no:cacheprovider -q -rxXfE 2>&1 | tail -30 | tee "$out/tests-gpu.txt"
