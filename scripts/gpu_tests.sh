#!/usr/bin/env bash
# Every GPU check in one call on a CUDA machine:
#   1. the GPU-only tests (pytest marker `gpu`: kernels in bf16 at real sizes, CUDA-graph padding,
#      backends against transformers, KV-cache sizing; on a machine with two GPUs also the
#      tensor-parallel all-reduce paths, tests/test_gpu_tp.py);
#   2. benchmarks/gpu_correctness.py on a Qwen3-0.6B-shaped random checkpoint: every backend with
#      CUDA graphs on and off against transformers bf16, printed as one table.
#
#   bash scripts/gpu_tests.sh [TOKENIZER_DIR]        (logs to $OUT or ./gpu-results)
# The Qwen3 tokenizer must be reachable: the argument, DELTASERVE_TEST_TOKENIZER, or ../shared.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
tok=${1:-${DELTASERVE_TEST_TOKENIZER:-}}
[ -n "$tok" ] && export DELTASERVE_TEST_TOKENIZER=$tok
timeout_flag=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 300")
python3 -m pytest -m gpu -q -rA -p no:cacheprovider $timeout_flag tests/ 2>&1 | tee "$out/gpu_tests.log"
status=${PIPESTATUS[0]}
ckpt=${CKPT_DIR:-/tmp/qwen3-0.6b-random}
[ -f "$ckpt/model.safetensors" ] || python3 benchmarks/make_checkpoint.py --shape qwen3-0.6b --out "$ckpt" ${tok:+--tokenizer "$tok"}
python3 benchmarks/gpu_correctness.py --model "$ckpt" --json "$out/correctness.json" 2>&1 | tee "$out/correctness.log"
correctness=${PIPESTATUS[0]}
exit $(( status || correctness ))
