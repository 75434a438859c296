"""The reference throughput benchmark: nano-vllm's bench.py workload through the public `LLM` API.

Workload (exactly nano-vllm's): `random.seed(0)`; 256 sequences; prompt lengths and max_tokens
each uniform in 100..1024; prompt token ids uniform in 0..10000; temperature 0.6; ignore_eos;
max_model_len 4096; 133,966 output tokens in all; one warm-up generate first.

Prints output tokens/s, the fraction of the KV-read roofline (every decode step must read each
running sequence's whole KV cache once: that many bytes over the GPU's copy bandwidth is the
shortest possible time), the mean decode step time at batch 256, the device idle time
between steps (from the workers' step log) and each process's CPU seconds per wall second.

`--filtered` gives every request top_p=0.9, top_k=50, repetition_penalty=1.1 and logprobs=5 (issue 11's
filtered workload: every row goes through workers/logits_processing.py and returns its logprobs);
the tokens are the same count, so the two runs compare directly.

`--mix chat` gives each request (drawn with its own seeded generator, so the prompts and lengths stay the
reference's) one of the parameter sets OpenAI-style clients send: temperature only 40%; top_p 0.95 30% (half of
them also top_k 40); frequency and presence penalty 0.5 15%; logprobs 1..5 10%; a JSON schema from a fixed set of
five 5% (a finished JSON value leaves only end tokens, which ignore_eos keeps drawing). The drawn mix is printed.

    python benchmarks/throughput.py --model DIR [--attention-backend triton] [--tp 2] [--filtered | --mix chat]
    python benchmarks/throughput.py --model DIR --kv-cache-dtype fp8
    python benchmarks/throughput.py --model DIR --profile-dir D [--profile-steps 200:240]

With `--profile-dir` the run is profiled (docs/profiling.md): steps 200..239 by default, 40 decode steps
at the full batch of 256 (the warm-up and the prompts' prefill take about the first 100 step ids);
D/summary.txt then gives the device's idle gaps between those steps from the trace beside the step log's
figure over the same steps. A profiled run is slower while it traces: take throughput from an
unprofiled one.

With `--kv-cache-dtype fp8` the roofline counts 1 byte per cached element (half the KV read of bf16);
the KV-cache capacity in tokens is printed either way.
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

from benchmarks.proc_stats import EngineCPU, format_cpu  # noqa: E402
from benchmarks.step_logs import run_main, step_log_folder  # noqa: E402
from common.config import load_hf_config  # noqa: E402

COPY_BANDWIDTH_TBS = 4.25  # measured device-to-device copy on an H200 (MISSION.md)
MISSION_ROOFLINE_TOKENS_PER_S = 36_000  # MISSION.md's KV-read bound for this workload on one H200 (Qwen3-0.6B)
PROFILE_STEPS = "200:240"  # full-batch decode steps of the measured run (the warm-up and prefill come first)


FILTERED = dict(top_p=0.9, top_k=50, repetition_penalty=1.1, logprobs=5)
_NAME = {"type": "string", "maxLength": 24}
MIX_SCHEMAS = (  # the five JSON schemas of --mix chat
    {"type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "neutral", "negative"]},
                                      "confidence": {"type": "number"}}, "required": ["sentiment", "confidence"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 8},
    {"type": "object", "properties": {"city": _NAME, "address": {"type": "object", "properties": {
        "street": _NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "zip"]}},
     "required": ["city", "address"]},
    {"type": "object", "properties": {"name": {"enum": ["get_weather", "search", "send_email"]},
                                      "arguments": {"type": "object", "properties": {"query": _NAME}}},
     "required": ["name", "arguments"]},
)


def chat_mix(n: int, seed: int = 1) -> tuple[list[dict], dict[str, int]]:
    """`n` parameter sets of the --mix chat shares (module docstring), drawn from `random.Random(seed)`, and the
    count of each kind."""
    rng = random.Random(seed)
    extras: list[dict] = []
    counts = {"temperature only": 0, "top_p": 0, "top_p + top_k": 0, "penalties": 0, "logprobs": 0, "json": 0}
    for _ in range(n):
        u = rng.random()
        if u < 0.40:
            kind, extra = "temperature only", {}
        elif u < 0.70:
            with_k = rng.random() < 0.5
            kind, extra = ("top_p + top_k", {"top_p": 0.95, "top_k": 40}) if with_k else ("top_p", {"top_p": 0.95})
        elif u < 0.85:
            kind, extra = "penalties", {"frequency_penalty": 0.5, "presence_penalty": 0.5}
        elif u < 0.95:
            kind, extra = "logprobs", {"logprobs": rng.randint(1, 5)}
        else:
            kind, extra = "json", {"structured_outputs": {"json": MIX_SCHEMAS[rng.randrange(len(MIX_SCHEMAS))]}}
        counts[kind] += 1
        extras.append(extra)
    return extras, counts


def workload(num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024, filtered: bool = False,
             mix: str | None = None):
    """nano-vllm's prompts and output lengths; `filtered` or `mix` ("chat") add sampling parameters without
    changing them."""
    from deltaserve import SamplingParams

    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))] for _ in range(num_seqs)]
    lengths = [random.randint(100, max_output_len) for _ in range(num_seqs)]
    extras = chat_mix(num_seqs)[0] if mix == "chat" else [FILTERED if filtered else {}] * num_seqs
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, **extra)
              for n, extra in zip(lengths, extras)]
    return prompts, params


def kv_read_bound_s(prompts: list[list[int]], params: list, kv_bytes_per_token: int, tbs: float) -> float:
    """Seconds to read, at `tbs` TB/s, the KV cache of every sequence once per decode step."""
    tokens_read = sum(len(p) * sp.max_tokens + sp.max_tokens * (sp.max_tokens - 1) // 2
                      for p, sp in zip(prompts, params))
    return tokens_read * kv_bytes_per_token / (tbs * 1e12)


def main() -> None:
    ap = argparse.ArgumentParser(description="nano-vllm's bench.py workload through deltaserve's LLM API")
    ap.add_argument("--model", required=True)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype, bf16) or fp8")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--deterministic", action="store_true",
                    help="deterministic mode (docs/deterministic.md)")
    ap.add_argument("--filtered", action="store_true",
                    help="every request also sets top_p=0.9, top_k=50, repetition_penalty=1.1, logprobs=5")
    ap.add_argument("--mix", choices=["chat"], default=None,
                    help="chat: each request draws a realistic set of sampling parameters (see the module docstring)")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    ap.add_argument("--profile-dir", default=None, help="profile the run into this folder (docs/profiling.md)")
    ap.add_argument("--profile-steps", default=PROFILE_STEPS, help="with --profile-dir: the steps traced, A:B")
    args = ap.parse_args()
    with step_log_folder() as step_dir:  # $DELTASERVE_STEP_LOG_DIR (kept for later analysis), else a temporary one
        benchmark(args, step_dir)


def benchmark(args: argparse.Namespace, step_dir: str) -> None:
    """Run the workload on one engine (its step logs in `step_dir`); print (and with --json write) the numbers."""
    from deltaserve import LLM, SamplingParams

    if args.filtered and args.mix:
        raise SystemExit("--filtered and --mix are two workloads: pass one")
    prompts, params = workload(args.num_seqs, filtered=args.filtered, mix=args.mix)
    if args.mix:
        mix = chat_mix(args.num_seqs)[1]
        print(f"--mix {args.mix} over {args.num_seqs} requests: " + ", ".join(f"{k} {v}" for k, v in mix.items()))
    total_tokens = sum(sp.max_tokens for sp in params)
    llm = LLM(args.model, max_model_len=4096, attention_backend=args.attention_backend, tensor_parallel_size=args.tp,
              block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype, profile_dir=args.profile_dir,
              deterministic=args.deterministic, **({"profile_steps": args.profile_steps} if args.profile_dir else {}))
    kv_capacity_tokens = llm.info["num_kv_blocks"] * llm.info["block_size"]
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    worker_log = os.path.join(step_dir, "worker-tp0.jsonl")
    skip = sum(1 for _ in open(worker_log)) if os.path.exists(worker_log) else 0
    cpu = EngineCPU(llm)
    cpu.start()
    t0, client_cpu0 = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    client_cpu = time.process_time() - client_cpu0
    # The step log is line-buffered: its last change is the worker's last step of the run.
    after_last_step = time.time() - os.path.getmtime(worker_log) if os.path.exists(worker_log) else None
    cpu_used = cpu.stop()
    llm.shutdown()
    assert sum(len(o["token_ids"]) for o in outputs) == total_tokens, "every request must produce max_tokens tokens"
    if args.filtered:
        assert all(len(o["outputs"][0]["logprobs"]) == len(o["token_ids"]) for o in outputs), "logprobs missing"

    steps = [json.loads(line) for line in open(worker_log)][skip:]
    full_decode = [s["gpu_ms"] for s in steps if s.get("decode") and s["rows"] == args.num_seqs and "gpu_ms" in s]
    idle = [s.get("idle_ms", 0.0) for s in steps]
    hf = load_hf_config(args.model)
    kv_bytes = 1 if args.kv_cache_dtype != "auto" else 2  # fp8 or bf16 K and V, all layers
    kv_per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * hf.head_dim * kv_bytes
    bound = kv_read_bound_s(prompts, params, kv_per_token, COPY_BANDWIDTH_TBS)
    result = {
        "output_tokens": total_tokens, "seconds": elapsed, "tokens_per_s": total_tokens / elapsed,
        "kv_read_bound_s": bound, "roofline_tokens_per_s": total_tokens / bound,
        "fraction_of_roofline": bound / elapsed, "steps": len(steps),
        "fraction_of_mission_roofline": total_tokens / elapsed / MISSION_ROOFLINE_TOKENS_PER_S,
        "mean_decode_step_ms_at_full_batch": statistics.mean(full_decode) if full_decode else None,
        "decode_steps_at_full_batch": len(full_decode),
        "gpu_busy_s": sum(s.get("gpu_ms", 0.0) for s in steps) / 1e3, "gpu_idle_between_steps_s": sum(idle) / 1e3,
        "mean_idle_between_steps_ms": statistics.mean(idle) if idle else None,
        "backend": args.attention_backend, "tp": args.tp, "block_size": args.block_size, "filtered": args.filtered,
        "mix": args.mix,
        "kv_cache_dtype": args.kv_cache_dtype, "kv_cache_capacity_tokens": kv_capacity_tokens,
        "cpu_s": cpu_used, "scheduler_cpu_per_wall_s": cpu_used["scheduler"] / elapsed,
        "client_cpu_s": client_cpu, "client_after_last_step_s": after_last_step,
        "kernel_compiles_mid_run": sum(s.get("compiles", 0) for s in steps),
    }
    print(f"Total: {total_tokens} tok, Time: {elapsed:.2f} s, Throughput: {total_tokens / elapsed:.0f} tok/s")
    print(f"fraction of the KV-read roofline (MISSION.md: {MISSION_ROOFLINE_TOKENS_PER_S} tok/s): "
          f"{100 * total_tokens / elapsed / MISSION_ROOFLINE_TOKENS_PER_S:.1f}%")
    print(f"(this script's own bound: {bound:.2f} s = {total_tokens / bound:.0f} tok/s reading each step's KV once "
          f"at {COPY_BANDWIDTH_TBS} TB/s; achieved {100 * bound / elapsed:.1f}% of it)")
    if full_decode:
        print(f"mean decode step at batch {args.num_seqs}: {statistics.mean(full_decode):.2f} ms "
              f"({len(full_decode)} steps)")
    print(f"device busy {result['gpu_busy_s']:.2f} s, idle between steps {result['gpu_idle_between_steps_s']:.3f} s "
          f"over {len(steps)} steps (mean {result['mean_idle_between_steps_ms'] or 0:.3f} ms)")
    timed = [st for st in steps if "gpu_ms" in st]
    prefill_ms = sum(st["gpu_ms"] for st in timed if not st.get("decode"))
    print(f"of which steps with prefill {prefill_ms / 1e3:.2f} s ({sum(not st.get('decode') for st in timed)} steps); "
          "slowest steps (device ms, rows, tokens, decode): " + ", ".join(
              f"{st['gpu_ms']:.1f} ({st['rows']}, {st['tokens']}, {bool(st.get('decode'))})"
              for st in sorted(timed, key=lambda st: -st["gpu_ms"])[:5]))
    if result["kernel_compiles_mid_run"]:  # workers/compile_watch.py: each held its step for the compile
        print(f"warning: {result['kernel_compiles_mid_run']} Triton kernels compiled during the run, in steps "
              + ", ".join(str(st["step"]) for st in steps if st.get("compiles")))
    print(f"process CPU: {format_cpu(cpu_used, elapsed)}; this client (LLM.generate) {client_cpu:.2f} s"
          + (f", returned {after_last_step:.2f} s after the worker's last step" if after_last_step is not None else ""))
    print(f"KV cache ({args.kv_cache_dtype}): {kv_capacity_tokens} tokens")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    run_main(main)
