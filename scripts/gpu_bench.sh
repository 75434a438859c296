#!/usr/bin/env bash
# The GPU benchmarks of benchmarks/RESULTS.md, in one call (a Qwen3-0.6B-shaped checkpoint is made first):
#   bash scripts/gpu_bench.sh [TOKENIZER_DIR]        (results to $OUT or ./gpu-results)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
tok=${1:-${DELTASERVE_TEST_TOKENIZER:-}}
ckpt=${CKPT_DIR:-/tmp/qwen3-0.6b-random}
[ -f "$ckpt/model.safetensors" ] || python3 benchmarks/make_checkpoint.py --shape qwen3-0.6b --out "$ckpt" ${tok:+--tokenizer "$tok"}
for backend in triton flash-attn; do
  timeout 300 python3 benchmarks/throughput.py --model "$ckpt" --attention-backend "$backend" \
      --json "$out/throughput-$backend.json" 2>&1 | tee "$out/throughput-$backend.log"
done
timeout 200 python3 benchmarks/kernels.py 2>&1 | tee "$out/kernels.log"
