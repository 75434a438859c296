"""The worker's step loop (workers/process.py): it overlaps a GPU step's result with the next step's launch, but a
step computed in full by `execute` (a CPU, no device event) is sent before the next one runs, so its tokens are
not held back a whole step (a fresh user saw CPU tokens stream in pairs and TTFT one step too long)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import zmq

from common import ipc
from common.protocol import Shutdown, StepPlan
from workers.process import WorkerProcess


@dataclass
class FakeStep:
    step_id: int
    event: Any  # None: done (CPU); else a device event, never ready here
    timings: dict = field(default_factory=dict)

    def ready(self) -> bool:
        return self.event is None


class FakeRunner:
    def __init__(self, with_event: bool) -> None:
        self.with_event = with_event
        self.calls: list[tuple[str, int]] = []

    def execute(self, plan: StepPlan) -> FakeStep:
        self.calls.append(("execute", plan.step_id))
        return FakeStep(plan.step_id, object() if self.with_event else None)

    def finalize(self, step: FakeStep) -> list[int]:
        self.calls.append(("send", step.step_id))
        return []


class Nothing:
    """Stands for the profiling, compile watch and step log: every call does nothing."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None

    @property
    def phases(self) -> Nothing:
        return self


def run_loop(with_event: bool) -> list[tuple[str, int]]:
    """Queue three plans and a shutdown, then run the loop over them as rank 1 (which sends no results)."""
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    pull.bind("inproc://plans")
    push.connect("inproc://plans")
    for step_id in range(3):
        ipc.send(push, StepPlan(step_id))
    ipc.send(push, Shutdown())
    worker = object.__new__(WorkerProcess)
    worker.plans, worker.rank, worker.external = pull, 1, False
    worker.runner = FakeRunner(with_event)
    worker.profiling = worker.compile_watch = worker.step_log = Nothing()
    try:
        worker._serve_steps()
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
    return worker.runner.calls


def test_a_cpu_step_is_sent_before_the_next_one_runs() -> None:
    assert run_loop(with_event=False) == [("execute", 0), ("send", 0), ("execute", 1), ("send", 1), ("execute", 2),
                                          ("send", 2)]


def test_a_gpu_step_is_sent_after_the_next_one_is_launched() -> None:
    assert run_loop(with_event=True) == [("execute", 0), ("execute", 1), ("send", 0), ("execute", 2), ("send", 1),
                                         ("send", 2)]
