"""Structured-output overhead on the GPU: decode steps at batch 64 with every row constrained by one JSON
schema, against the same batch unconstrained, for two schemas and each structured-outputs backend.

    python benchmarks/structured_output.py --model DIR [--num-seqs 64] [--max-tokens 256]
        [--backends auto xgrammar] [--schemas stress tool] [--max-steps-in-flight K] [--json OUT]

DIR: a checkpoint of the Qwen3-0.6B shape (benchmarks/make_checkpoint.py), or the trained demo model's folder
(SmolLM2-135M-Instruct, the real case: it closes its strings). Random weights are the hard case: the
model never wants what the grammar allows, so each row takes a near-uniform token among those allowed and stays
inside long strings (benchmarks/grammar_libraries.py's random walk shows the same on CPU). The schemas:
- stress: an array of at least 50 records of benchmarks/grammar_libraries.py's 20-field schema (formats, patterns,
  bounded strings and numbers, enums, nested objects);
- tool: an array of at least 50 tool calls (`TOOL_CALL_SCHEMA`: objects, strings, integers, a number, enums,
  arrays, a boolean; no formats or patterns), what most function-calling schemas look like.
Both are arrays so that no row completes its grammar within `--max-tokens` (a complete grammar allows only end
tokens, whose mask costs nothing) and every step fills 64 real masks. Prompts: 64 x 32 random token ids;
ignore_eos; the same seeds in every run.

Prints, for each backend (one engine each: `structured_outputs_backend`) and schema, the mean decode step at the
full batch: the interval between the starts of consecutive steps (what a user's TPOT sees), the device time of a
step (`gpu_ms`), the host time spent waiting for the previous step's tokens (advancing the matchers by them and
sending that step's result) and filling the masks, and the worker's host time (preparing the step's inputs,
launching it with the grammar's work, and the rest of the interval outside that launch); then the overhead
(constrained interval / unconstrained interval - 1; target: under 10%), and the first request's wait for its
grammar (compilation, and the tokenizer's one-time set-up for the first schema) against the same request once the
grammar is cached.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.grammar_libraries import SCHEMA_20_FIELDS, TOOL_CALL_SCHEMA  # noqa: E402
from benchmarks.step_logs import run_main, step_log_folder  # noqa: E402
from common.config import STRUCTURED_OUTPUTS_BACKENDS  # noqa: E402

SCHEMAS = {"stress": {"type": "array", "items": SCHEMA_20_FIELDS, "minItems": 50},
           "tool": {"type": "array", "items": TOOL_CALL_SCHEMA, "minItems": 50}}


def decode_steps(log_path: str, skip: int, rows: int) -> list[dict]:
    """The full-batch decode steps after the first `skip` lines of a worker's step log, each with `interval_ms`
    (from its start to the next step's start)."""
    steps = [json.loads(line) for line in open(log_path)][skip:]
    for a, b in zip(steps, steps[1:]):
        a["interval_ms"] = (b["t_start"] - a["t_start"]) * 1e3
    return [s for s in steps[:-1] if s.get("decode") and s["rows"] == rows]


def run_backend(args: argparse.Namespace, backend: str, prompts: list[list[int]], log_path: str) -> dict:
    """One engine with `backend`: the compile times of each schema, then the unconstrained run and one constrained
    run per schema."""
    from deltaserve import LLM, SamplingParams

    # Every constrained request runs to max_tokens on purpose (ignore_eos), which the frontend warns about once per
    # request (its JSON is left incomplete): ERROR keeps those 64 lines per schema out of the figures.
    llm = LLM(args.model, max_model_len=2048, structured_outputs_backend=backend, log_level="ERROR",
              max_steps_in_flight=args.max_steps_in_flight)
    results: dict[str, dict] = {}
    try:
        llm.generate(["Benchmark: "], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        for name in args.schemas:
            one = SamplingParams(max_tokens=1, structured_outputs={"json": SCHEMAS[name]})
            t0 = time.perf_counter()
            first = llm.generate([prompts[0]], one, use_tqdm=False)[0]
            first_s = time.perf_counter() - t0  # compilation (+ the tokenizer's set-up the first time) + a prefill
            assert first["finish_reason"] == "length", first
            t0 = time.perf_counter()
            llm.generate([prompts[0]], one, use_tqdm=False)
            results[f"compile {name}"] = {"first_request_s": first_s, "cached_s": time.perf_counter() - t0}
        for name in ["unconstrained", *args.schemas]:
            so = None if name == "unconstrained" else {"json": SCHEMAS[name]}
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
                "grammar_mask_ms": statistics.mean(s.get("grammar_mask_ms", 0.0) for s in steps),
                "grammar_mask_p99_ms": sorted(s.get("grammar_mask_ms", 0.0) for s in steps)[
                    int(0.99 * (len(steps) - 1))],
                # The worker's host time: applying the plan and preparing the inputs, launching the step (the
                # grammar's wait and masks included), and outside `execute` (plans, results, idle).
                "prepare_ms": statistics.mean(s["prepare_ms"] for s in steps),
                "launch_ms": statistics.mean(s["launch_ms"] for s in steps)}
            x = results[name]
            x["outside_ms"] = x["step_interval_ms"] - x["prepare_ms"] - x["launch_ms"]
    finally:
        llm.shutdown()
    base = results["unconstrained"]["step_interval_ms"]
    for name in args.schemas:
        results[name]["overhead"] = results[name]["step_interval_ms"] / base - 1
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True,
                    help="checkpoint folder: the Qwen3-0.6B shape (benchmarks/make_checkpoint.py) or the demo model")
    ap.add_argument("--num-seqs", type=int, default=64, help="requests, all running at once (default 64)")
    ap.add_argument("--max-tokens", type=int, default=256, help="output tokens of every request (default 256)")
    ap.add_argument("--backends", nargs="+", choices=STRUCTURED_OUTPUTS_BACKENDS, default=["auto", "xgrammar"],
                    help="structured-outputs backends, one engine each (default: auto xgrammar)")
    ap.add_argument("--schemas", nargs="+", choices=list(SCHEMAS), default=list(SCHEMAS),
                    help="JSON schemas to time against the unconstrained batch (default: all)")
    ap.add_argument("--max-steps-in-flight", type=int, default=2,
                    help="steps the scheduler plans ahead of the results, 1-4 (the engine's option; default 2)")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args()
    for name in ("num_seqs", "max_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    import torch

    if not torch.cuda.is_available():
        print("note: no CUDA GPU here: the engine runs on the CPU, device times read 0, and the figures say nothing "
              "about the GPU overhead this benchmark is for", file=sys.stderr, flush=True)
    from common.config import ConfigError

    with step_log_folder() as step_dir:  # $DELTASERVE_STEP_LOG_DIR (kept), else a temporary one
        try:
            benchmark(args, os.path.join(step_dir, "worker-tp0.jsonl"))
        except ConfigError as exc:  # a setting the engine refuses (the model folder, steps in flight): one line
            ap.error(str(exc))


def benchmark(args: argparse.Namespace, log_path: str) -> None:
    """Measure every backend of `args` (the worker's step log: `log_path`); print and with --json write the numbers."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(32)] for _ in range(args.num_seqs)]
    results: dict[str, object] = {"num_seqs": args.num_seqs, "max_tokens": args.max_tokens}
    for backend in args.backends:
        results[backend] = r = run_backend(args, backend, prompts, log_path)
        print(f"backend {backend}:")
        for name in ["unconstrained", *args.schemas]:
            x = r[name]
            line = (f"  {name:>13}: decode step at batch {args.num_seqs} {x['step_interval_ms']:.2f} ms between "
                    f"starts, {x['gpu_ms']:.2f} ms on the device ({x['decode_steps']} steps)")
            if name != "unconstrained":
                line += (f"; host: the last step's tokens (wait, matchers, its result sent) "
                         f"{x['grammar_wait_ms']:.2f} ms, masks "
                         f"{x['grammar_mask_ms']:.2f} ms (p99 {x['grammar_mask_p99_ms']:.2f}); "
                         f"overhead {x['overhead'] * 100:.1f}% (target < 10%)")
            print(line)
            print(f"  {'':>13}  worker: prepare {x['prepare_ms']:.2f} ms, launch {x['launch_ms']:.2f} ms (the "
                  f"grammar's included), outside the step's launch {x['outside_ms']:.2f} ms")
        for name in args.schemas:
            c = r[f"compile {name}"]
            print(f"  compile {name}: first request with the schema {c['first_request_s'] * 1e3:.0f} ms, then "
                  f"{c['cached_s'] * 1e3:.0f} ms cached")
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    run_main(main)
