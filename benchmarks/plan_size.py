"""Wire size and scheduler CPU cost of a steady decode step (CPU only, runs in a few seconds).

    python benchmarks/plan_size.py

The step plan is built by the real `Scheduler`: 256 requests with 100-token prompts are admitted
and prefilled (block size 256, the reference engine's), their sampled tokens fed back, then the
requests decode with one step in flight, as in the scheduler process. Positions 100..254 all lie in
each request's first block, so every measured step is a plain decode step: 256 decode rows, no
new blocks, no admissions, nothing finished. Measured per step:

- the msgpack size of the encoded `StepPlan` (target: at most 2 KiB);
- the median wall time of `Scheduler.schedule()`, and of schedule + `encode` + `process_result`
  of the step's result, i.e. the scheduler's whole CPU cost per step without the sockets
  (target: at most 0.5 ms each). The process does nothing else meanwhile, so wall time is CPU time.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

# The repository root must come before benchmarks/ on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.protocol import EngineRequest, StepResult, encode, i32  # noqa: E402
from scheduler_proc.scheduler import Scheduler, SchedulerConfig  # noqa: E402

NUM_REQUESTS = 256
BLOCK_SIZE = 256
PROMPT_LEN = 100
MAX_PLAN_BYTES = 2048
MAX_STEP_MS = 0.5
RUNS = 4


def prefilled_scheduler(rng: np.random.Generator) -> tuple[Scheduler, StepResult | None]:
    """A scheduler whose requests all finished prefill; returns it and the result still in flight."""
    sched = Scheduler(SchedulerConfig(num_kv_blocks=2 * NUM_REQUESTS, block_size=BLOCK_SIZE, max_model_len=4096,
                                      max_num_seqs=NUM_REQUESTS, max_num_batched_tokens=8192))
    for i in range(NUM_REQUESTS):
        prompt = i32(rng.integers(1000, 20000, size=PROMPT_LEN))
        errors = sched.add_request(EngineRequest(i, prompt, 0.0, 10_000, None, [0], 0.0))
        assert not errors, errors
    pending: StepResult | None = None
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.seqs.values()) or sched.waiting:
        plan = sched.schedule()
        assert plan is not None
        if pending is not None:
            sched.process_result(pending)
        pending = result_of(plan.step_id, len(sched.in_flight[-1].sampling_seqs), rng)
    return sched, pending


def result_of(step_id: int, num_sampled: int, rng: np.random.Generator) -> StepResult:
    return StepResult(step_id, i32(rng.integers(1, 50_000, size=num_sampled)))


def measure() -> tuple[list[int], list[float], list[float]]:
    """Plan sizes (bytes), schedule() times and full per-step times (ms) of every steady decode step."""
    sizes: list[int] = []
    schedule_ms: list[float] = []
    total_ms: list[float] = []
    rng = np.random.default_rng(0)
    for _ in range(RUNS):
        sched, pending = prefilled_scheduler(rng)
        while True:
            t0 = time.perf_counter()
            plan = sched.schedule()
            t1 = time.perf_counter()
            data = encode(plan)
            if pending is not None:
                sched.process_result(pending)
            t2 = time.perf_counter()
            assert plan is not None
            longest = max(s.num_tokens for s in sched.seqs.values())
            if longest > BLOCK_SIZE:  # the next step would cross into a second block
                break
            steady = (len(plan.decode_seq_ids) == NUM_REQUESTS and not plan.new_blocks and not plan.new_requests
                      and not plan.prefill_seq_ids.size and not plan.finished_seq_ids.size)
            if steady:
                sizes.append(len(data))
                schedule_ms.append((t1 - t0) * 1e3)
                total_ms.append((t2 - t0) * 1e3)
            pending = result_of(plan.step_id, len(sched.in_flight[-1].sampling_seqs), rng)
    return sizes, schedule_ms, total_ms


def main() -> None:
    import argparse

    argparse.ArgumentParser(description=__doc__.splitlines()[0],
                            epilog="No options: it runs as shown in the usage above.").parse_args()
    sizes, schedule_ms, total_ms = measure()
    assert sizes, "no steady decode step was measured"
    size = max(sizes)
    sched_med, total_med = statistics.median(schedule_ms), statistics.median(total_ms)
    rows = [
        (f"plan size, {NUM_REQUESTS} decode rows (msgpack)", f"{size} B", f"<= {MAX_PLAN_BYTES} B",
         size <= MAX_PLAN_BYTES),
        ("schedule() per step, median", f"{sched_med:.3f} ms", f"<= {MAX_STEP_MS} ms", sched_med <= MAX_STEP_MS),
        ("schedule + encode + process_result, median", f"{total_med:.3f} ms", f"<= {MAX_STEP_MS} ms",
         total_med <= MAX_STEP_MS),
    ]
    print(f"steady decode: {NUM_REQUESTS} requests, block size {BLOCK_SIZE}, prompts of {PROMPT_LEN} tokens; "
          f"{len(schedule_ms)} steps measured over {RUNS} runs")
    print(f"{'metric':<46} {'value':>10} {'target':>12}  result")
    for name, value, target, ok in rows:
        print(f"{name:<46} {value:>10} {target:>12}  {'PASS' if ok else 'FAIL'}")
    p90 = lambda xs: float(np.percentile(xs, 90))  # noqa: E731
    print(f"(p90: schedule() {p90(schedule_ms):.3f} ms, whole step {p90(total_ms):.3f} ms; "
          f"plan sizes {min(sizes)}..{max(sizes)} B)")


if __name__ == "__main__":
    main()
