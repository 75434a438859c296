"""Structured-output overhead on the GPU: decode steps at batch 64 with every row constrained by one JSON
schema, against the same batch unconstrained, and the compile time of that schema.

    python benchmarks/structured_output.py --model DIR [--num-seqs 64] [--max-tokens 256] [--json OUT]

DIR: a checkpoint of the Qwen3-0.6B shape (benchmarks/make_checkpoint.py; random weights are the hard case,
since the model never wants what the grammar allows). The schema is an array of at least 50 records of
benchmarks/grammar_libraries.py's 20-field schema, so no row completes its grammar within `--max-tokens`
(a complete grammar allows only end tokens, whose mask costs nothing) and every step fills 64 real masks.
Prompts: 64 x 32 random token ids; ignore_eos; the same seeds in both runs.

Prints, for each run, the mean decode step at the full batch: the interval between the starts of
consecutive steps (what a user's TPOT sees), the device time of a step (`gpu_ms`), and for the constrained
run the host time spent waiting for the previous step's tokens and filling the masks; then the overhead
(constrained interval / unconstrained interval - 1; target: under 10%), and the schema's compile time
(the first request's wait for its grammar, and xgrammar's own compile time on the Qwen3 vocabulary).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.grammar_libraries import SCHEMA_20_FIELDS  # noqa: E402

SCHEMA = {"type": "array", "items": SCHEMA_20_FIELDS, "minItems": 50}


def decode_steps(log_path: str, skip: int, rows: int) -> list[dict]:
    """The full-batch decode steps after the first `skip` lines of a worker's step log, each with `interval_ms`
    (from its start to the next step's start)."""
    steps = [json.loads(line) for line in open(log_path)][skip:]
    for a, b in zip(steps, steps[1:]):
        a["interval_ms"] = (b["t_start"] - a["t_start"]) * 1e3
    return [s for s in steps[:-1] if s.get("decode") and s["rows"] == rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args()
    step_dir = os.environ.get("DELTASERVE_STEP_LOG_DIR") or tempfile.mkdtemp(prefix="deltaserve-steps-")
    os.environ["DELTASERVE_STEP_LOG_DIR"] = step_dir
    from transformers import AutoTokenizer

    from deltaserve import LLM, SamplingParams

    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(32)] for _ in range(args.num_seqs)]
    llm = LLM(args.model, max_model_len=2048)
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    log_path = os.path.join(step_dir, "worker-tp0.jsonl")
    results: dict[str, object] = {"num_seqs": args.num_seqs, "max_tokens": args.max_tokens}

    t0 = time.perf_counter()
    first = llm.generate([prompts[0]], SamplingParams(max_tokens=1, structured_outputs={"json": SCHEMA}),
                         use_tqdm=False)[0]
    results["first_request_with_the_schema_s"] = time.perf_counter() - t0  # compile + one prefill
    t0 = time.perf_counter()
    llm.generate([prompts[0]], SamplingParams(max_tokens=1, structured_outputs={"json": SCHEMA}), use_tqdm=False)
    results["same_request_cached_s"] = time.perf_counter() - t0
    assert first["finish_reason"] == "length", first

    for name, so in (("unconstrained", None), ("constrained", {"json": SCHEMA})):
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, ignore_eos=True,
                                 structured_outputs=so) for i in range(args.num_seqs)]
        skip = sum(1 for _ in open(log_path)) if os.path.exists(log_path) else 0
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        assert all(len(o["token_ids"]) == args.max_tokens for o in outs), "every request must run max_tokens"
        steps = decode_steps(log_path, skip, args.num_seqs)
        results[name] = {
            "elapsed_s": elapsed, "decode_steps": len(steps),
            "step_interval_ms": statistics.mean(s["interval_ms"] for s in steps),
            "gpu_ms": statistics.mean(s.get("gpu_ms", 0.0) for s in steps),  # 0 on CPU (no CUDA events)
            "grammar_wait_ms": statistics.mean(s.get("grammar_wait_ms", 0.0) for s in steps),
            "grammar_mask_ms": statistics.mean(s.get("grammar_mask_ms", 0.0) for s in steps)}
    llm.shutdown()
    overhead = results["constrained"]["step_interval_ms"] / results["unconstrained"]["step_interval_ms"] - 1
    results["overhead"] = overhead

    import xgrammar as xgr

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=151936)
    compiler = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=False)
    t0 = time.perf_counter()
    compiler.compile_json_schema(json.dumps(SCHEMA), max_whitespace_cnt=20)
    results["xgrammar_compile_s"] = time.perf_counter() - t0

    for name in ("unconstrained", "constrained"):
        r = results[name]
        print(f"{name:>13}: decode step at batch {args.num_seqs} {r['step_interval_ms']:.2f} ms between starts, "
              f"{r['gpu_ms']:.2f} ms on the device ({r['decode_steps']} steps); host: waiting for the last "
              f"tokens {r['grammar_wait_ms']:.2f} ms, masks {r['grammar_mask_ms']:.2f} ms")
    print(f"overhead: {overhead * 100:.1f}% (target < 10%)")
    first_ms, cached_ms = results["first_request_with_the_schema_s"] * 1e3, results["same_request_cached_s"] * 1e3
    print(f"compile: xgrammar {results['xgrammar_compile_s'] * 1e3:.0f} ms; first request with the schema "
          f"{first_ms:.0f} ms, then {cached_ms:.0f} ms cached")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
