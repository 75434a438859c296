"""Where a decode step's time goes on the GPU, in one worker process (no scheduler, no sockets).

For a checkpoint (e.g. the Qwen3-0.6B shape) at batch 256 with a given context: the model
forward as a CUDA graph, sampling, the whole step (synchronous, and pipelined as the worker runs
it), and the kernels of the CUDA-graph forward and of one eager decode step from torch.profiler.

    python benchmarks/profile_step.py --model DIR [--batch 256] [--context 600] [--attention-backend triton] [--tp 1]
                                      [--filtered] [--deterministic]

`--filtered`: every request sets top_p=0.9, top_k=50, repetition_penalty=1.1 and logprobs=5, so every row
goes through the logits processing (workers/logits_processing.py); the sampling line then times that
processing plus the sampler and the logprobs, and says its share of the pipelined step.

With `--tp N` each rank runs in its own process on GPU `rank` (all run the same steps, rank 0 prints);
the kernel table then shows what a rank spends on its shard and on the all-reduces.
`--deterministic`: the batch-invariant kernels of deterministic mode (workers/deterministic.py), to see what each
costs against the default kernels.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common.config import EngineConfig  # noqa: E402
from common.protocol import NewRequest, SamplingOptions, StepPlan, i32  # noqa: E402
from workers.logits_processing import build_processing, gather_vocabulary  # noqa: E402
from workers.model_runner import ModelRunner  # noqa: E402
from workers.sampler import ProcessedRows  # noqa: E402

FILTERED = SamplingOptions(top_p=0.9, top_k=50, repetition_penalty=1.1, logprobs=5)


def cuda_ms(fn, repeat: int = 20) -> float:
    """Median device time of `fn()` in milliseconds."""
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, one process and GPU each")
    ap.add_argument("--host-profile", action="store_true",
                    help="also run the pipelined steps under cProfile and print where the host's time goes")
    ap.add_argument("--filtered", action="store_true",
                    help="requests set top_p=0.9, top_k=50, repetition_penalty=1.1, logprobs=5")
    ap.add_argument("--deterministic", action="store_true", help="deterministic mode's batch-invariant kernels")
    args = ap.parse_args()
    if args.tp == 1:
        profile_rank(0, args, "tcp://127.0.0.1:0")
        return
    import torch.multiprocessing as mp

    from benchmarks.allreduce import free_port

    mp.spawn(profile_rank, nprocs=args.tp, join=True, args=(args, f"tcp://127.0.0.1:{free_port()}"))


def profile_rank(rank: int, args: argparse.Namespace, dist_init: str) -> None:
    b, ctx, bs = args.batch, args.context, 16
    cfg = EngineConfig(model=args.model, max_model_len=4096, max_num_seqs=b, cuda_graph_sizes=(b,), block_size=bs,
                       attention_backend=args.attention_backend, tensor_parallel_size=args.tp,
                       deterministic=args.deterministic).resolve()
    runner = ModelRunner(cfg, rank, dist_init)
    say = print if rank == 0 else (lambda *a, **k: None)
    per_seq = -(-(ctx + 200) // bs)
    runner.allocate_kv_cache(b * per_seq)
    runner.capture_cuda_graphs()
    rng = np.random.default_rng(0)
    step = 0
    per_plan = max(1, cfg.max_num_batched_tokens // ctx)
    for first in range(0, b, per_plan):
        reqs = [NewRequest(i, i32(rng.integers(0, 10000, ctx)), args.temperature, None,
                           i32(range(i * per_seq, (i + 1) * per_seq)), 0, ctx, FILTERED if args.filtered else None)
                for i in range(first, min(b, first + per_plan))]
        runner.finalize(runner.execute(StepPlan(step, new_requests=reqs)))
        step += 1
    decode = StepPlan(0, decode_seq_ids=i32(range(b)))

    def one_step() -> None:
        runner.finalize(runner.execute(decode))

    for _ in range(3):
        one_step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 30
    for _ in range(n):
        one_step()
    sync_ms = (time.perf_counter() - t0) / n * 1e3
    t0 = time.perf_counter()
    run_pipelined(runner, decode, n)
    pipelined_ms = (time.perf_counter() - t0) / n * 1e3
    if args.host_profile:
        host_profile(runner, decode, say)
    graph, out = runner.cuda_graphs.graphs[b]
    forward_ms = cuda_ms(graph.replay)
    idle_launch, busy_launch = [], []  # host time of graph.replay() on an idle device, and behind another replay
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        t1 = time.perf_counter()
        graph.replay()
        idle_launch.append(t1 - t0)
        busy_launch.append(time.perf_counter() - t1)
    torch.cuda.synchronize()
    hidden = out[:b]
    logits_ms = cuda_ms(lambda: runner.model.compute_logits(hidden))
    logits = runner.model.compute_logits(hidden)
    temps = torch.full((b,), args.temperature, device=logits.device)
    sampler, processor = runner.sampling.sampler, runner.sampling.processor
    sample_ms = cuda_ms(lambda: sampler(logits, temps, all_greedy=False))
    greedy_ms = cuda_ms(lambda: sampler(logits, torch.zeros_like(temps), all_greedy=True))
    states = [runner.batch.reqs[i] for i in range(b)]
    processing = build_processing(states, np.full(b, args.temperature, np.float32), processor.vocab_size)

    @torch.inference_mode()  # the penalty counts are inference tensors: updated in place only under it
    def processed_sampling() -> None:
        """What a step does for processed rows: upload, gather, the pipeline, the sampler, logprobs, counts."""
        d = processor.upload(processing)
        x = gather_vocabulary(logits[d.i["rows"]], processor.vocab_size, runner.model.lm_head.rows_per_rank)
        x = processor.apply(x, d, runner.last_sampled)
        tokens = sampler(logits, temps, False, None,
                         ProcessedRows(d.i["rows"], processing.rows, x, d.f["sample_temperatures"], True))
        processor.record_sampled(d, tokens)
        processor.logprobs(x, d, tokens)

    filtered_ms = cuda_ms(processed_sampling) if processing is not None else None
    say(f"batch {b}, context ~{ctx}, backend {runner.backend.name}, dtype {runner.dtype}"
        f"{', filtered requests' if args.filtered else ''}{', deterministic' if args.deterministic else ''}")
    say(f"model forward (CUDA graph)   {forward_ms:7.3f} ms")
    say(f"host time of graph.replay()  {statistics.median(idle_launch) * 1e3:7.3f} ms on an idle device, "
        f"{statistics.median(busy_launch) * 1e3:.3f} ms behind another replay")
    say(f"LM head                      {logits_ms:7.3f} ms")
    say(f"sampling T={args.temperature}              {sample_ms:7.3f} ms   (greedy {greedy_ms:.3f} ms)")
    if filtered_ms is not None:
        say(f"sampling top_p=0.9 top_k=50 repetition_penalty=1.1 logprobs=5: {filtered_ms:7.3f} ms")
    say(f"whole step, synchronous      {sync_ms:7.3f} ms wall")
    say(f"whole step, pipelined        {pipelined_ms:7.3f} ms wall")
    used = filtered_ms if filtered_ms is not None else sample_ms
    say(f"sampler share of the pipelined step: {100 * used / pipelined_ms:.1f}% ({used:.3f} of {pipelined_ms:.3f} ms)")

    from torch.profiler import ProfilerActivity, profile

    def kernel_table(what: str, fn, rows: int) -> None:
        """Profile one call of `fn` and print its kernels, the costliest first."""
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        total = sum(e.self_device_time_total for e in events)
        count = sum(e.count for e in events)
        say(f"{what}: {count} kernels, {total / 1e3:.3f} ms of device time")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:rows]:
            say(f"{e.self_device_time_total / 1e3:8.3f} ms {e.count:5d}x  {e.key[:110]}")

    if filtered_ms is not None:
        kernel_table("processed sampling (filtered rows)", processed_sampling, 20)
    # Inside a graph the kernels still run one after another: their sum against the replay's time above is the
    # share lost to launch gaps and ramps between kernels.
    kernel_table("model forward as a CUDA graph", graph.replay, 25)
    runner.cuda_graphs.graphs.clear()  # profile the eager step: every kernel is visible
    one_step()
    kernel_table("eager decode step", one_step, 25)


def run_pipelined(runner: ModelRunner, plan: StepPlan, steps: int) -> None:
    """`steps` steps of `plan` as the worker runs them: each launched before the previous one is finalized."""
    pending = runner.execute(plan)
    for _ in range(steps - 1):
        nxt = runner.execute(plan)
        runner.finalize(pending)
        pending = nxt
    runner.finalize(pending)


def host_profile(runner: ModelRunner, plan: StepPlan, say) -> None:
    """200 pipelined steps under cProfile: the host functions that cost the most, by own time and in all."""
    import cProfile
    import pstats

    steps = 200
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    run_pipelined(runner, plan, steps)
    prof.disable()
    say(f"host profile: {steps} pipelined steps, {(time.perf_counter() - t0) / steps * 1e3:.3f} ms a step under "
        "cProfile (times below are per run of all steps)")
    stats = pstats.Stats(prof)
    for order in ("tottime", "cumulative"):
        stats.sort_stats(order).print_stats(28)


if __name__ == "__main__":
    main()
