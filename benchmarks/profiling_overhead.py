"""What the profiling code costs when profiling is off (CPU only, runs in seconds).

    python benchmarks/profiling_overhead.py

Every loop marks its phases (`common/profiling.py`) whether or not a session runs: off, each mark is one
method call that returns at once. This times, with profiling off, exactly the calls one step makes in each
process (the scheduler's 9, a worker's 11, the frontend's 3), and sets the scheduler's against its whole
CPU cost of a 256-request decode step (`benchmarks/plan_size.py`: schedule + encode + process_result),
the loop where the marks weigh most. A GPU decode step at batch 256 takes about 6.6 ms (RESULTS.md).
"""

from __future__ import annotations

import statistics
import sys
import timeit
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.plan_size import measure  # noqa: E402
from common.config import DEFAULT_PROFILE_STEPS  # noqa: E402
from common.profiling import FrontendProfiling, SchedulerProfiling, WorkerProfiling  # noqa: E402

STEPS = 200_000
GPU_DECODE_STEP_MS = 6.64  # batch 256, Qwen3-0.6B shape, triton backend (RESULTS.md)


def per_step_ns(step) -> float:
    """Median over 5 runs of the nanoseconds one call of `step()` takes."""
    runs = timeit.repeat(step, number=STEPS, repeat=5)
    return statistics.median(runs) / STEPS * 1e9


def main() -> None:
    import argparse

    argparse.ArgumentParser(description=__doc__.splitlines()[0],
                            epilog="No options: it runs as shown in the usage above.").parse_args()
    off = SimpleNamespace(profile_dir=None, profile_steps=DEFAULT_PROFILE_STEPS, tensor_parallel_size=1)
    sched = SchedulerProfiling(off, "run", lambda msg: None, lambda msg: None)
    worker = WorkerProfiling(off, "run", 0, "cpu")
    frontend = FrontendProfiling(off, "run", lambda client, msg: None, lambda msg: None)
    sp, wp, fp = sched.phases, worker.phases, frontend.phases
    timings = {}

    def scheduler_step() -> None:  # as SchedulerProcess.serve runs one step
        sched.before_step(7, True)
        sp.begin("schedule", 7)
        sp.begin("encode", 7)
        sp.begin("send", 7)
        sp.end()
        sched.after_plan(7)
        sp.begin("process result", 6)
        sp.end()
        sched.after_result(6)

    def worker_step() -> None:  # ModelRunner.execute and WorkerProcess._finish
        wp.begin("apply plan", 7)
        wp.begin("prepare inputs", 7)
        wp.begin("upload", 7)
        wp.begin("graph replay", 7)
        wp.begin("sample", 7)
        wp.end()
        wp.begin("wait", 6)
        wp.begin("send result", 6)
        wp.end()
        worker.step_done(6, timings)

    def frontend_step() -> None:  # FrontendProcess._handle_scheduler
        fp.begin("detokenize", 6)
        fp.begin("send to clients", 6)
        fp.end()

    def nothing() -> None:
        pass

    base = per_step_ns(nothing)
    costs = {name: per_step_ns(fn) - base for name, fn in
             (("scheduler (9 calls)", scheduler_step), ("worker (11 calls)", worker_step),
              ("frontend (3 calls)", frontend_step))}
    _, _, total_ms = measure()
    step_ms = statistics.median(total_ms)
    print(f"profiling off: what one step's marks cost, median of 5 x {STEPS} steps (less a bare call's {base:.0f} ns)")
    for name, ns in costs.items():
        print(f"  {name:<22} {ns:7.0f} ns a step = {100 * ns / (GPU_DECODE_STEP_MS * 1e6):.4f}% of a "
              f"{GPU_DECODE_STEP_MS} ms GPU decode step")
    ns = costs["scheduler (9 calls)"]
    print(f"  the scheduler's CPU for a 256-request decode step (schedule + encode + process_result): "
          f"{step_ms:.3f} ms; its marks add {100 * ns / (step_ms * 1e6):.3f}% to it")


if __name__ == "__main__":
    main()
