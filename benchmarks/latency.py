"""Latency of one batch, vLLM's `benchmark_latency` shape, through the public `LLM` API.

Each iteration submits `--batch-size` prompts of `--input-len` random token ids (uniform in
0..10000, fresh ones every iteration so that nothing is a prefix-cache hit) with `max_tokens =
--output-len`, `ignore_eos` and `--temperature` (vLLM's default 1.0; `--top-p`, `--top-k`, `--min-p`,
`--repetition-penalty` and `--logprobs` add those parameters), and waits for all of them.
After `--num-iters-warmup` unmeasured iterations, `--num-iters` measured ones report:

- latency: seconds per iteration (mean, p50, p99), and output tokens/s = batch x output_len / latency;
- TTFT: each request's time to first token, from the engine's own metrics (submission to first token);
- TPOT: each request's time per output token after the first, (e2e - TTFT) / (output_len - 1), and
  decode tokens/s = batch / TPOT;
- per-token latency: the time from one decode step's start to the next's, from the worker's step log
  (`DELTASERVE_STEP_LOG_DIR`): how often each running request gets a token (step ends would pair up on a
  CPU, where a pipelined step computes while it is launched and the previous one is finalized after it,
  so their gaps alternate between a few ms and two steps); on a GPU also the device
  time of each decode step and the device's idle time before it (host-bound steps show idle time);
- on a GPU, the host chain: from a decode step's tokens reaching the host to the launch of the step planned
  from its result (step N+2 for step N; N+K with `--max-steps-in-flight K`), part by part (worker, sockets, the
  scheduler's result processing and planning, the worker's launch), against the device steps running meanwhile
  (from the worker's and the scheduler's step logs);
- prefill mode (`--output-len 1`): prompt tokens/s = batch x input_len / the time until the last first
  token, and over the device time of the prefill steps (GPU).

Several batch sizes (`--batch-size 1 8 32`) are measured one after another on one engine; `--json` writes
a list with one result per batch size.

    python benchmarks/latency.py --model DIR --input-len 100 --output-len 512 --batch-size 1 8 32
    python benchmarks/latency.py --model DIR --input-len 1024 --output-len 1 --batch-size 32 \\
        --max-num-batched-tokens 32768                                       # prefill
    python benchmarks/latency.py --model DIR --input-len 100 --output-len 512 --batch-size 1 \\
        --profile-dir D --profile-steps 1200:1240                            # a trace of 40 decode steps
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.step_logs import run_main, step_log_folder  # noqa: E402

DEFAULT_PROFILE_STEPS = "1200:1240"  # the engine numbers its steps from the start, warm-up iterations included


def percentiles(values: list[float]) -> dict[str, float] | None:
    """mean, p50 and p99 of `values`; None if there are none."""
    if not values:
        return None
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99))}


def fmt(stats: dict[str, float], scale: float = 1e3, unit: str = "ms") -> str:
    return (f"mean {stats['mean'] * scale:.3f} {unit}, p50 {stats['p50'] * scale:.3f} {unit}, "
            f"p99 {stats['p99'] * scale:.3f} {unit}")


def read_steps(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def measure(llm, args: argparse.Namespace, batch_size: int, rng: np.random.Generator) -> dict:
    """Warm-up and measured iterations at one batch size on a running engine: the raw timings."""
    from deltaserve import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True,
                            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            repetition_penalty=args.repetition_penalty, logprobs=args.logprobs)
    raw: dict = {"windows": [], "latencies": [], "ttfts": [], "tpots": [], "cached": 0}
    for i in range(args.num_iters_warmup + args.num_iters):
        prompts = rng.integers(0, 10000, size=(batch_size, args.input_len)).tolist()
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        t1 = time.perf_counter()
        errors = [o["error"] for o in outputs if o["error"]]
        if errors:
            raise RuntimeError(f"a request failed: {errors[0]}")
        assert all(len(o["token_ids"]) == args.output_len for o in outputs), "ignore_eos gives max_tokens tokens"
        if i < args.num_iters_warmup:
            continue
        raw["windows"].append((t0, t1))
        raw["latencies"].append(t1 - t0)
        raw["cached"] += sum(o["num_cached_tokens"] for o in outputs)
        for o in outputs:
            ttft, e2e = o["metrics"]["ttft_s"], o["metrics"]["e2e_s"]
            raw["ttfts"].append(ttft)
            if args.output_len > 1:
                raw["tpots"].append((e2e - ttft) / (args.output_len - 1))
    return raw


def summarize(raw: dict, steps: list[dict], args: argparse.Namespace, batch_size: int, info: dict) -> dict:
    """The reported numbers of one batch size, from its raw timings and the worker's step log."""
    per_token, device, idle, prefill_device_s, prefill_wall = [], [], [], 0.0, []
    for t0, t1 in raw["windows"]:
        mine = sorted((s for s in steps if t0 <= s.get("t_done", -1.0) <= t1), key=lambda s: s["t_start"])
        for prev, step in zip(mine, mine[1:]):
            if step.get("decode") and prev.get("decode"):  # not the prefill's time to the first decode step
                per_token.append(step["t_start"] - prev["t_start"])
                if "gpu_ms" in step:
                    device.append(step["gpu_ms"] / 1e3)
                    idle.append(step.get("idle_ms", 0.0) / 1e3)
        prefill_device_s += sum(s.get("gpu_ms", 0.0) for s in mine if not s.get("decode")) / 1e3
        first_token_done = [s["t_done"] for s in mine if not s.get("decode")]
        if first_token_done:
            prefill_wall.append(max(first_token_done) - t0)
    lat, tpot = percentiles(raw["latencies"]), percentiles(raw["tpots"])
    prompt_tokens = batch_size * args.input_len
    return {
        "batch_size": batch_size, "input_len": args.input_len, "output_len": args.output_len,
        "num_iters": args.num_iters, "backend": args.attention_backend, "kv_cache_dtype": args.kv_cache_dtype,
        "cuda_graphs": not args.enforce_eager and any("cuda" in d for d in info.get("devices", [])),
        "tp": args.tp, "deterministic": args.deterministic, "temperature": args.temperature, "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p, "repetition_penalty": args.repetition_penalty, "logprobs": args.logprobs,
        "latency_s": lat, "ttft_s": percentiles(raw["ttfts"]), "tpot_s": tpot,
        "per_token_latency_s": percentiles(per_token),
        "decode_step_device_s": percentiles(device), "device_idle_before_decode_step_s": percentiles(idle),
        "output_tokens_per_s": batch_size * args.output_len / lat["mean"],
        "decode_tokens_per_s": batch_size / tpot["mean"] if tpot else None,
        "prompt_tokens_per_s": prompt_tokens / float(np.mean(prefill_wall)) if prefill_wall else None,
        "prompt_tokens_per_device_s": prompt_tokens * args.num_iters / prefill_device_s if prefill_device_s else None,
        "kernel_compiles_mid_run": sum(s.get("compiles", 0) for s in steps
                                       if any(t0 <= s.get("t_done", -1.0) <= t1 for t0, t1 in raw["windows"])),
        "num_cached_tokens": raw["cached"], "kv_cache_tokens": info.get("num_kv_blocks", 0) * info.get("block_size", 0),
        "devices": info.get("devices"),
    }


CHAIN_PARTS = ("worker", "to scheduler", "result", "schedule", "to worker", "launch")


def host_chain(steps: list[dict], plans: list[dict], windows: list[tuple[float, float]]) -> dict | None:
    """Where the host's time goes between a decode step's tokens reaching the host and the launch of the step that
    waits for its result (the scheduler plans step N+K once step N's result is in, K = max_steps_in_flight, 2 by
    default). Mean ms of each part over the decode steps of `windows`, from the worker's (`steps`) and the
    scheduler's (`plans`) step logs, with the device time of the K-1 steps in between: a chain longer than they
    leaves the device idle.

    worker: the worker's own work on the result (logprobs to their wire form, encoding, sending); to scheduler:
    the socket and the scheduler's wake-up; result: the scheduler's processing of it, with its outputs sent to the
    frontend; schedule: planning, encoding and sending the plan; to worker: the socket and the worker's wake-up;
    launch: the worker's input preparation and launch (its `prepare_ms` + `launch_ms`). None without the fields
    (a log from an older engine, or a CPU run)."""
    by_step = {s["step"]: s for s in steps}
    parts: list[list[float]] = [[] for _ in CHAIN_PARTS]
    device: list[float] = []
    for plan in plans:
        k, n = plan.get("after_result", -1), plan["step"]
        done, nxt = by_step.get(k), by_step.get(n)
        if done is None or nxt is None or "t_tokens" not in done or "t_result_sent" not in done:
            continue
        if not (done.get("decode") and nxt.get("decode")) or not any(t0 <= nxt["t_done"] <= t1 for t0, t1 in windows):
            continue
        result_end = plan["t_result"] + plan["result_ms"] / 1e3
        values = (done["t_result_sent"] - done["t_tokens"], plan["t_result"] - done["t_result_sent"],
                  plan["result_ms"] / 1e3, plan["t_sent"] - result_end, nxt["t_start"] - plan["t_sent"],
                  (nxt["prepare_ms"] + nxt["launch_ms"]) / 1e3)
        for part, v in zip(parts, values):
            part.append(v)
        between = [by_step.get(j) for j in range(k + 1, n)]
        if between and all(b is not None and "gpu_ms" in b for b in between):
            device.append(sum(b["gpu_ms"] for b in between) / 1e3)
    if not parts[0]:
        return None
    chain = {name: float(np.mean(p)) for name, p in zip(CHAIN_PARTS, parts)}
    chain["total"] = float(np.mean(np.sum(parts, axis=0)))
    chain["device_step"] = float(np.mean(device)) if device else None
    return chain


def run(args: argparse.Namespace) -> list[dict]:
    """Start one engine, measure every batch size of `args.batch_size` on it in turn, return the numbers."""
    with step_log_folder("deltaserve-latency-steps-") as step_dir:  # $DELTASERVE_STEP_LOG_DIR, else a temporary one
        return run_engine(args, step_dir)


def run_engine(args: argparse.Namespace, step_dir: str) -> list[dict]:
    from deltaserve import LLM

    engine_args = dict(max_model_len=args.input_len + args.output_len, max_num_seqs=max(*args.batch_size, 256),
                       max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.attention_backend,
                       kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager,
                       tensor_parallel_size=args.tp, block_size=args.block_size, dtype=args.dtype, device=args.device,
                       deterministic=args.deterministic, max_steps_in_flight=args.max_steps_in_flight)
    if args.kv_cache_memory_gb is not None:
        engine_args["kv_cache_memory_gb"] = args.kv_cache_memory_gb
    if args.profile_dir:
        engine_args.update(profile_dir=args.profile_dir, profile_steps=args.profile_steps)
    llm = LLM(args.model, **engine_args)
    rng = np.random.default_rng(args.seed)
    try:
        raws = [measure(llm, args, batch_size, rng) for batch_size in args.batch_size]
        info = dict(llm.info)
    finally:
        llm.shutdown()
    steps = read_steps(os.path.join(step_dir, "worker-tp0.jsonl"))
    plans = read_steps(os.path.join(step_dir, "scheduler.jsonl"))
    results = [summarize(raw, steps, args, batch_size, info) for raw, batch_size in zip(raws, args.batch_size)]
    for r, raw in zip(results, raws):
        r["host_chain_s"] = host_chain(steps, plans, raw["windows"])
    return results


def sampling_flags(r: dict) -> str:
    """The sampling parameters beyond temperature that the run set, for its summary line ('' if none)."""
    off = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "logprobs": None}
    return "".join(f", {name} {r[name]:g}" for name, default in off.items() if r.get(name, default) != default)


def report(r: dict) -> None:
    print(f"batch {r['batch_size']}, input {r['input_len']} tokens, output {r['output_len']} tokens, "
          f"{r['num_iters']} iterations; backend {r['backend']}, KV cache {r['kv_cache_dtype']} "
          f"({r['kv_cache_tokens']} tokens), CUDA graphs {'on' if r['cuda_graphs'] else 'off'}, TP {r['tp']}, "
          f"temperature {r['temperature']:g}{sampling_flags(r)}, {r['devices']}")
    print(f"latency per iteration: {fmt(r['latency_s'], 1.0, 's')}; output {r['output_tokens_per_s']:.1f} tok/s")
    print(f"TTFT: {fmt(r['ttft_s'])}")
    if r["decode_tokens_per_s"] is not None:
        print(f"TPOT: {fmt(r['tpot_s'])}; decode {r['decode_tokens_per_s']:.1f} tok/s")
    if r["per_token_latency_s"] is not None:
        print(f"per-token latency (decode step start to start): {fmt(r['per_token_latency_s'])}")
    if r["decode_step_device_s"] is not None:  # on a GPU: how much of a step is device work, how much waiting
        print(f"device time per decode step: {fmt(r['decode_step_device_s'])}; device idle before it: "
              f"{fmt(r['device_idle_before_decode_step_s'])}")
    chain = r.get("host_chain_s")
    if chain is not None and chain["device_step"] is not None:  # on a GPU
        print("host chain from a decode step's tokens to the launch of the step planned after them (mean ms): "
              + ", ".join(f"{name} {chain[name] * 1e3:.3f}" for name in CHAIN_PARTS)
              + f"; total {chain['total'] * 1e3:.3f} against the {chain['device_step'] * 1e3:.3f} ms of device steps "
              "in between")
    if r["prompt_tokens_per_s"] is not None and r["output_len"] == 1:
        device = r["prompt_tokens_per_device_s"]
        print(f"prefill: {r['prompt_tokens_per_s']:.0f} prompt tok/s (submission to the last first token)"
              + (f", {device:.0f} prompt tok/s of device time" if device else ""))
    if r["kernel_compiles_mid_run"]:
        print(f"warning: {r['kernel_compiles_mid_run']} Triton kernels compiled during the measured iterations")
    if r["num_cached_tokens"]:
        print(f"warning: {r['num_cached_tokens']} prompt tokens were prefix-cache hits")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, nargs="+", default=[8],
                    help="one or more batch sizes, measured in turn on one engine")
    ap.add_argument("--num-iters-warmup", type=int, default=10)
    ap.add_argument("--num-iters", type=int, default=30)
    ap.add_argument("--temperature", type=float, default=1.0)
    # Sampling parameters beyond temperature put every row on the processed path (docs/parameters.md).
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="0: off")
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--logprobs", type=int, default=None, help="top-N logprobs of each sampled token")
    ap.add_argument("--seed", type=int, default=0, help="of the random prompts")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--deterministic", action="store_true",
                    help="deterministic mode (docs/deterministic.md)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-steps-in-flight", type=int, default=2,
                    help="steps the scheduler plans ahead of the results, 1-4 (the engine's option; default 2)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    ap.add_argument("--profile-dir", default=None,
                    help="profile the run into this folder (docs/profiling.md); a profiled run is slower")
    ap.add_argument("--profile-steps", default=None, metavar="A:B",
                    help=f"with --profile-dir: trace the engine's steps A..B-1 (default {DEFAULT_PROFILE_STEPS}: the "
                         "third iteration of a batch-1 run of 512 output tokens, after two warm-up iterations)")
    args = ap.parse_args(argv)
    for name in ("input_len", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.batch_size) < 1:
        ap.error("--batch-size must be at least 1")
    if args.num_iters_warmup < 0:
        ap.error("--num-iters-warmup must be at least 0")
    from common.config import ConfigError, parse_profile_steps

    if args.profile_dir is None and args.profile_steps is not None:
        ap.error("--profile-steps needs --profile-dir")
    args.profile_steps = args.profile_steps or DEFAULT_PROFILE_STEPS
    try:
        parse_profile_steps(args.profile_steps)
        results = run(args)
    except ConfigError as exc:  # a bad setting the engine refuses (device, profile folder, ...): one line
        ap.error(str(exc))
    for result in results:
        report(result)
    print(json.dumps(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    run_main(main)
