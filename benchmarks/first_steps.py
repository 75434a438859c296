"""The first steps after start-up, in one process: what still compiles, and which launch waits on the GPU.

Runs the scheduler and one model runner in this process (no sockets) on the throughput benchmark's
workload: start-up exactly as a worker does it (memory profile, KV cache, CUDA graphs), a warm-up
request, then `--steps` steps of the benchmark, one at a time. For every step it prints the host time
of `execute` (planning excluded) and the device time; a launch that takes as long as the device
means the host waited on the GPU. With `--sync-debug`, torch reports each synchronizing call
(`torch.cuda.set_sync_debug_mode("warn")`). Triton compilations are counted per step.

    TORCH_LOGS=recompiles python benchmarks/first_steps.py --model DIR [--steps 40] [--sync-debug]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.throughput import workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sync-debug", action="store_true")
    args = ap.parse_args()

    import triton

    from common.config import EngineConfig
    from common.protocol import EngineRequest, StepResult, i32
    from scheduler_proc.scheduler import Scheduler, SchedulerConfig
    from workers.model_runner import ModelRunner

    compiled: list[str] = []
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.runtime, "jit_post_compile_hook"):
        def hook(*_, **kwargs):
            fn = kwargs.get("fn")
            compiled.append(getattr(getattr(fn, "fn", fn), "__name__", str(fn)))
            return False
        knobs.runtime.jit_post_compile_hook = hook

    cfg = EngineConfig(model=args.model, max_model_len=4096, attention_backend=args.attention_backend).resolve()
    t0 = time.perf_counter()
    runner = ModelRunner(cfg, 0, "tcp://127.0.0.1:0")
    num_blocks = min(runner.max_num_kv_blocks(), 200_000)
    runner.allocate_kv_cache(num_blocks)
    runner.capture_cuda_graphs()
    print(f"start-up {time.perf_counter() - t0:.1f} s, {len(compiled)} Triton compilations", flush=True)
    compiled.clear()
    sched = Scheduler(SchedulerConfig(num_kv_blocks=num_blocks, block_size=cfg.block_size,
                                      max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
                                      max_num_batched_tokens=cfg.max_num_batched_tokens))
    prompts, params = workload()
    requests = [EngineRequest(0, i32([100, 200, 300]), 0.6, 16, None, [], time.time())]  # the warm-up generate
    requests += [EngineRequest(i + 1, i32(p), sp.temperature, sp.max_tokens, None, [], time.time())
                 for i, (p, sp) in enumerate(zip(prompts, params))]
    for r in requests[:1]:
        sched.add_request(r)

    def run_step(label: str) -> bool:
        plan = sched.schedule()
        if plan is None:
            return False
        cuda = runner.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        before = len(compiled)
        t = time.perf_counter()
        if args.sync_debug and cuda:
            torch.cuda.set_sync_debug_mode("warn")
        step = runner.execute(plan)
        if step is None:  # a plan of deltas only (finished requests): nothing ran
            return True
        launch_ms = (time.perf_counter() - t) * 1e3
        if args.sync_debug and cuda:
            torch.cuda.set_sync_debug_mode(0)
        tokens = runner.finalize(step)
        total_ms = (time.perf_counter() - t) * 1e3
        sched.process_result(StepResult(plan.step_id, i32(tokens)))
        new = compiled[before:]
        print(f"{label} step {plan.step_id:3d}: {step.timings['tokens']:5d} tokens, {step.timings['rows']:3d} rows, "
              f"graph {step.timings['graph']:3d} | launch {launch_ms:8.2f} ms, done {total_ms:8.2f} ms, "
              f"device {step.timings.get('gpu_ms', 0):7.2f} ms" + (f" | compiled {new}" if new else ""), flush=True)
        return True

    while run_step("warm-up"):
        pass
    for r in requests[1:]:
        sched.add_request(r)
    for _ in range(args.steps):
        if not run_step("bench"):
            break


if __name__ == "__main__":
    main()
