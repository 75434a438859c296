#!/usr/bin/env bash
# Run every GPU-only test (pytest marker `gpu`) on a CUDA machine, in one call:
#   bash scripts/gpu_tests.sh            (logs to $OUT or ./gpu-results)
# The Qwen3 tokenizer must be reachable: ../shared, the deltaserve cache, or DELTASERVE_TEST_TOKENIZER.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/ 2>&1 | tee "$out/gpu_tests.log"
exit "${PIPESTATUS[0]}"
