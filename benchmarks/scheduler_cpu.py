"""How much CPU the scheduler process uses per second of wall time, for workloads of several shapes.

The scheduler must block on its sockets whenever it cannot plan (steps in flight, every running
request finishing in the step in flight, waiting requests that do not fit yet): then it needs a few
hundredths of a CPU-second per wall second. A scheduler that polls without a timeout uses 1.0, and
on CPU takes that core from the workers.

    python benchmarks/scheduler_cpu.py [--model DIR] [--device cpu|cuda] [--shapes max_tokens_1,...]

Shapes (prompts are token ids, so every shape is the same on any tokenizer):
- max_tokens_1: 256 short prompts (8-24 tokens) with max_tokens 1, every request finishing at prefill;
- max_tokens_4: the same prompts with max_tokens 4 (more work, for comparison);
- long_prefill: 4 prompts of 2,000 tokens, max_tokens 1, prefilled in chunks of 512 tokens;
- steady_decode: 32 prompts of 64 tokens, 128 output tokens each (ignore_eos);
- kv_bound: 64 prompts of 128 tokens, 32 output tokens each, in a KV cache that holds 8 of them,
  so that most requests wait for blocks;
- decode_256: 256 prompts of 32 tokens, 512 output tokens each: full-batch decode steps of 256 rows, where
  each host process's CPU per step (also printed, over ~512 steps) bounds a small model's throughput
  (issue 33 target 4: at most 0.5 ms each); meant for a GPU (--device cuda), where the worker's compute does
  not take the host processes' cores.
Prints, per shape: wall seconds, output tokens, and every process's CPU seconds and CPU seconds
per wall second. Default model: the built-in demo model (downloaded and converted once).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.proc_stats import EngineCPU, format_cpu  # noqa: E402


@dataclass
class Shape:
    num_prompts: int
    prompt_len: tuple[int, int]  # uniform in [low, high]
    max_tokens: int
    engine: dict

    def prompts(self) -> list[list[int]]:
        import numpy as np

        rng = np.random.default_rng(0)
        lens = rng.integers(self.prompt_len[0], self.prompt_len[1] + 1, size=self.num_prompts)
        return [rng.integers(1000, 20000, size=n).tolist() for n in lens]


SHAPES = {
    "max_tokens_1": Shape(256, (8, 24), 1, {"max_model_len": 256}),
    "max_tokens_4": Shape(256, (8, 24), 4, {"max_model_len": 256}),
    "long_prefill": Shape(4, (2000, 2000), 1, {"max_model_len": 2048, "max_num_batched_tokens": 512}),
    "steady_decode": Shape(32, (64, 64), 128, {"max_model_len": 256}),
    "kv_bound": Shape(64, (128, 128), 32, {"max_model_len": 256, "num_kvcache_blocks": 8 * 10}),
    "decode_256": Shape(256, (32, 32), 512, {"max_model_len": 1024, "max_num_seqs": 256}),
}


def run_shape(model: str, name: str, shape: Shape, device: str) -> dict:
    from deltaserve import LLM, SamplingParams

    llm = LLM(model, device=device, **shape.engine)
    try:
        llm.generate([[1000, 1001, 1002]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
        cpu = EngineCPU(llm)
        params = SamplingParams(temperature=0, max_tokens=shape.max_tokens, ignore_eos=True)
        prompts = shape.prompts()
        cpu.start()
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        used = cpu.stop()
    finally:
        llm.shutdown()
    errors = [o["error"] for o in outputs if o["error"]]
    if errors:
        raise RuntimeError(f"{name}: {len(errors)} requests failed, e.g. {errors[0]}")
    tokens = sum(len(o["token_ids"]) for o in outputs)
    steps = -(-tokens // min(shape.num_prompts, shape.engine.get("max_num_seqs", 256)))  # at full batch
    per_step = ", ".join(f"{p} {1e3 * s / steps:.2f}" for p, s in used.items())
    print(f"{name}: {wall:.2f} s wall, {tokens} output tokens | {format_cpu(used, wall)} | CPU ms per step of "
          f"{min(shape.num_prompts, 256)} rows (~{steps} steps): {per_step}", flush=True)
    return {"shape": name, "wall_s": wall, "output_tokens": tokens, "cpu_s": used,
            "scheduler_cpu_per_wall_s": used["scheduler"] / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the built-in demo model)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from frontend.default_model import ensure_default_model

        model = ensure_default_model()
    names = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    results = [run_shape(model, name, SHAPES[name], args.device) for name in names]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
