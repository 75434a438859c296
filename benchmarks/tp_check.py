"""Tensor parallelism on GPUs: TP=1 against TP=N on one checkpoint, for agreement and throughput.

1. 32 prompts, 16 greedy tokens each: the fraction of prompts whose 16 tokens are identical under
   TP=1 and TP=N (bf16 sums in another order may flip a near-tie; the target is >= 90%).
2. The reference throughput workload (benchmarks/throughput.py, nano-vllm's bench.py) at each TP.

    python benchmarks/tp_check.py --model DIR --tp 2 [--skip-throughput]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.throughput import workload  # noqa: E402


def run(model: str, tp: int, prompts: list[list[int]], skip_throughput: bool, backend: str) -> dict:
    from deltaserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, max_model_len=4096, tensor_parallel_size=tp, attention_backend=backend)
    start_s = time.perf_counter() - t0
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    result = {"tp": tp, "start_s": start_s, "greedy": [o["token_ids"] for o in greedy]}
    if not skip_throughput:
        bench_prompts, params = workload()
        llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
        t0 = time.perf_counter()
        llm.generate(bench_prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        total = sum(sp.max_tokens for sp in params)
        result.update(seconds=elapsed, tokens_per_s=total / elapsed)
        print(f"TP={tp}: {total} tokens in {elapsed:.2f} s = {total / elapsed:.0f} tok/s", flush=True)
    llm.shutdown()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--hf-reference", action="store_true",
                    help="also compare both runs with transformers bf16 and print its logit margin where they diverge")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = random.Random(1)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(16, 512))] for _ in range(32)]
    one = run(args.model, 1, prompts, args.skip_throughput, args.attention_backend)
    many = run(args.model, args.tp, prompts, args.skip_throughput, args.attention_backend)
    same = sum(a == b for a, b in zip(one["greedy"], many["greedy"]))
    first_token = sum(a[0] == b[0] for a, b in zip(one["greedy"], many["greedy"]))
    summary = {"model": args.model, "tp": args.tp, "backend": args.attention_backend, "prompts": len(prompts),
               "identical_16_tokens": same,
               "identical_first_token": first_token, "start_s": [one["start_s"], many["start_s"]]}
    print(f"TP=1 vs TP={args.tp}: {same}/{len(prompts)} prompts with 16 identical greedy tokens "
          f"({100 * same / len(prompts):.0f}%), first token {first_token}/{len(prompts)}")
    if not args.skip_throughput:
        speedup = many["tokens_per_s"] / one["tokens_per_s"]
        summary.update(tokens_per_s={"1": one["tokens_per_s"], str(args.tp): many["tokens_per_s"]}, speedup=speedup)
        print(f"throughput TP=1 {one['tokens_per_s']:.0f} tok/s, TP={args.tp} {many['tokens_per_s']:.0f} tok/s: "
              f"{speedup:.2f}x")
    if args.hf_reference:
        import torch

        from benchmarks.gpu_correctness import compare_tokens, hf_reference

        ref = hf_reference(args.model, prompts, torch.bfloat16, "sdpa", "cuda")
        for name, run_ in (("TP=1", one), (f"TP={args.tp}", many)):
            cmp = compare_tokens(run_["greedy"], ref)
            summary[f"vs_transformers_{name}"] = cmp
            print(f"{name} vs transformers bf16: {cmp['identical']}/{len(prompts)} identical over 16 tokens; "
                  f"transformers' logit margin where they diverge: {sorted(cmp['margins_at_divergence'])}")
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
