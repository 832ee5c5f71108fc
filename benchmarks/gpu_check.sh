#!/usr/bin/env bash
# Every GPU check in one go (under 5 minutes), for a short loan of a GPU:
#   bash benchmarks/gpu_check.sh [OUT_DIR]
# 1. the Triton kernel tests compiled on the GPU (the same tests CI runs under the interpreter,
#    here including the bfloat16 tensor-core dot), 2. the GPU benchmark (JSON to OUT_DIR).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-results}"
mkdir -p "$out"
python -m pytest -q -p no:cacheprovider tests/test_triton_kernel.py -k triton 2>&1 | tee "$out/gpu_triton_tests.log"
python -m benchmarks.gpu_attention --dtype bf16 --json "$out/attention_gpu.json" 2>&1 | tee "$out/gpu_attention.log"
