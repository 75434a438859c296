"""Our engine against Hugging Face `transformers` on the GPU, bf16, same weights: one table.

For 32 prompts of mixed lengths (token ids, seed 0) on a Qwen3-shaped checkpoint:

1. First-step logits: each attention backend's prefill logits (in-process `ModelRunner`) against
   transformers bf16, as the relative error ||ours - hf|| / ||hf|| per prompt (the worst is shown).
2. Greedy tokens: the first 16 greedy tokens through the whole engine (`LLM`, every process), for
   every backend, with CUDA graphs on and off; the share of prompts whose 16 tokens equal
   transformers'.
3. The floor of that comparison: two correct bf16 implementations, transformers with its SDPA
   attention and with its eager attention, compared the same way. Where a run diverges from the
   reference, the reference's own logit margin between the two tokens at that step is printed:
   a margin no larger than the floor's largest first-step logit difference is a near-tie: bf16
   logits are coarse (steps of 1/64 near 2.0), so with random weights exact ties are common and
   any reordering of a sum flips some of them.

    python benchmarks/gpu_correctness.py --model DIR [--backends triton flash-attn torch] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

NUM_PROMPTS, NEW_TOKENS = 32, 16


def make_prompts(seed: int = 0) -> list[list[int]]:
    """32 prompts, lengths from a few tokens to several blocks, ids in 0..10000."""
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(3, 40), rng.randint(40, 300), rng.randint(300, 1100)])
               for _ in range(NUM_PROMPTS)]
    return [[rng.randint(0, 10000) for _ in range(n)] for n in lengths]


def hf_reference(model_dir: str, prompts: list[list[int]], dtype: torch.dtype, attn: str, device: str,
                 num_tokens: int = NEW_TOKENS) -> dict:
    """transformers' `num_tokens` greedy tokens per prompt ("tokens") and the float32 logits
    `[num_tokens, vocab]` along that greedy path ("logits", on the CPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn).to(device).eval()
    tokens, logits = [], []
    with torch.inference_mode():
        for ids in prompts:
            input_ids = torch.tensor([ids], device=device)
            # An explicit mask: without it generate() masks every prompt token equal to pad_token_id.
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=num_tokens,
                                 do_sample=False, min_new_tokens=num_tokens, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
            tokens.append(out.sequences[0, len(ids):].tolist())
            logits.append(torch.stack([step[0].float() for step in out.logits]).cpu())
    del model
    return {"tokens": tokens, "logits": logits}


def our_first_step_logits(model_dir: str, prompts: list[list[int]], backend: str, device: str,
                          dtype: str) -> list[torch.Tensor]:
    """Prefill every prompt in one step of an in-process ModelRunner; the logits the sampler sees."""
    import numpy as np

    from common.config import EngineConfig
    from common.protocol import NewRequest, StepPlan, i32
    from workers.model_runner import ModelRunner

    total = sum(len(p) for p in prompts)
    cfg = EngineConfig(model=model_dir, device=device, dtype=dtype, block_size=16, max_model_len=4096,
                       max_num_seqs=len(prompts), max_num_batched_tokens=total, enforce_eager=True,
                       attention_backend=backend).resolve()
    runner = ModelRunner(cfg, 0, "tcp://127.0.0.1:0")
    blocks_needed = [-(-len(p) // 16) for p in prompts]
    runner.allocate_kv_cache(sum(blocks_needed) + 1)
    captured: list[torch.Tensor] = []
    sample = runner.sampler

    def capture(logits, *args, **kwargs):
        captured.append(logits.float().cpu())
        return sample(logits, *args, **kwargs)

    runner.sampler = capture
    starts = np.cumsum([0, *blocks_needed])
    plan = StepPlan(0, new_requests=[
        NewRequest(i, i32(p), 0.0, None, i32(range(starts[i], starts[i + 1])), 0, len(p))
        for i, p in enumerate(prompts)])
    runner.finalize(runner.execute(plan))
    del runner
    return list(captured[0])


def our_greedy(model_dir: str, prompts: list[list[int]], backend: str, eager: bool, device: str,
               dtype: str) -> list[list[int]]:
    from deltaserve import LLM, SamplingParams

    llm = LLM(model_dir, device=device, dtype=dtype, max_model_len=4096, attention_backend=backend, enforce_eager=eager,
              max_num_seqs=64, cuda_graph_sizes=[1, 2, 4, 8, 16, 32, 64], kv_cache_memory_gb=4.0)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    return [o["token_ids"] for o in outs]


def relative_errors(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> list[float]:
    return [((a - b).norm() / b.norm()).item() for a, b in zip(ours, ref)]


def compare_tokens(tokens: list[list[int]], ref: dict) -> dict:
    """How many prompts equal the reference over all 16 tokens; the reference's logit margin at each divergence."""
    same, margins = 0, []
    for ours, hf, hf_logits in zip(tokens, ref["tokens"], ref["logits"]):
        if ours == hf:
            same += 1
            continue
        step = next(i for i, (a, b) in enumerate(zip(ours, hf)) if a != b)
        margins.append(round((hf_logits[step, hf[step]] - hf_logits[step, ours[step]]).item(), 4))
    return {"identical": same, "margins_at_divergence": margins}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--backends", nargs="+", default=["triton", "flash-attn", "torch"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="the dtype of the reference and of our runs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    prompts = make_prompts()
    print(f"{len(prompts)} prompts, lengths {sorted(len(p) for p in prompts)}", flush=True)

    t0 = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    ref = hf_reference(args.model, prompts, dtype, "sdpa", args.device)
    floor = hf_reference(args.model, prompts, dtype, "eager", args.device)
    ref32 = hf_reference(args.model, prompts, torch.float32, "sdpa", args.device)
    first = [step[0] for step in ref["logits"]]
    logit_std = torch.stack(first).std().item()
    rows: list[dict] = []

    def add(name: str, tokens: list[list[int]], first_logits: list[torch.Tensor] | None) -> None:
        row = {"run": name, **compare_tokens(tokens, ref)}
        if first_logits is not None:
            row["first_step_rel_err_max"] = max(relative_errors(first_logits, first))
            row["first_step_max_abs_err"] = max((a - b).abs().max().item() for a, b in zip(first_logits, first))
        rows.append(row)
        print(json.dumps(row), flush=True)

    add(f"transformers {args.dtype} eager attention (floor)", floor["tokens"], [s[0] for s in floor["logits"]])
    add("transformers fp32", ref32["tokens"], [s[0] for s in ref32["logits"]])
    print(f"references done in {time.perf_counter() - t0:.0f} s", flush=True)
    for backend in args.backends:
        try:
            logits = our_first_step_logits(args.model, prompts, backend, args.device, args.dtype)
        except Exception as exc:  # a backend that cannot run here (e.g. no FlashAttention) is reported, not fatal
            rows.append({"run": backend, "error": repr(exc)})
            print(f"{backend}: cannot run: {exc!r}", flush=True)
            continue
        modes = [("eager", True)] if backend == "torch" else [("CUDA graphs", False), ("eager", True)]
        for mode, eager in modes:
            tokens = our_greedy(args.model, prompts, backend, eager, args.device, args.dtype)
            add(f"deltaserve {backend}, {mode}", tokens, logits)

    # Two correct implementations differ by up to this much in a logit: a smaller margin is a near-tie.
    noise = rows[0]["first_step_max_abs_err"]
    print(f"\nreference: transformers {args.dtype} (SDPA attention); logit std at the first step {logit_std:.3f}; "
          f"near-tie: a margin <= {noise:.4f} (the floor's largest first-step logit difference)")
    print(f"{'run':<45} {'16 tokens identical':>20} {'or near-tie':>11} {'first-step rel err':>19} {'max abs':>8}  "
          f"reference's margin where it diverged")
    for r in rows:
        if "error" in r:
            print(f"{r['run']:<45} cannot run: {r['error'][:80]}")
            continue
        pct = 100 * r["identical"] / len(prompts)
        r["identical_or_near_tie"] = r["identical"] + sum(m <= noise for m in r["margins_at_divergence"])
        print(f"{r['run']:<45} {r['identical']:>6}/{len(prompts)} ({pct:5.1f}%) {r['identical_or_near_tie']:>11} "
              f"{r['first_step_rel_err_max']:>19.2e} "
              f"{r['first_step_max_abs_err']:>8.3f}  {sorted(r['margins_at_divergence'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "prompts": len(prompts), "logit_std": logit_std, "rows": rows}, f,
                      indent=2)


if __name__ == "__main__":
    main()
