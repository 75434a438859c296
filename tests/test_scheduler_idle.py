"""The scheduler process blocks on its sockets whenever it cannot plan (it must not spin a core).

The real `SchedulerProcess` loop runs in a thread over real ZeroMQ sockets; the test plays the
frontend and a worker that holds a step's result back. While the scheduler waits, the CPU time of
its thread is read from the thread's own clock: a loop that polls without a timeout burns about
one CPU-second per second there, a blocking one almost none.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from common import ipc
from common.config import EngineConfig
from common.protocol import (
    AddRequests,
    EngineReady,
    InitKVCache,
    KVCacheReady,
    Ping,
    Shutdown,
    StepOutputs,
    StepPlan,
    StepResult,
    WorkerReady,
    i32,
)
from scheduler_proc.process import SchedulerProcess
from tests.fake_worker import make_request, synthetic_prompt

HOLD_S = 1.5  # how long the test's worker sits on a step before answering
MAX_BUSY_CPU_S = 0.3  # the scheduler's CPU time allowed meanwhile (spinning takes about HOLD_S)


class SchedulerHarness:
    """A scheduler thread, with the test holding the frontend's and worker rank 0's ends of its sockets."""

    def __init__(self, tmp_path: Path, num_kv_blocks: int, **config: object) -> None:
        (tmp_path / "config.json").write_text("{}")
        self.config = EngineConfig(model=str(tmp_path), max_model_len=1024, vocab_size=50_000, block_size=16,
                                   num_kvcache_blocks=num_kv_blocks, **config)
        self.endpoints = ipc.Endpoints.create(1)
        ctx = zmq.Context.instance()
        e = self.endpoints
        self.control = ipc.make_socket(ctx, zmq.PULL, e.control, bind=True)
        self.frontend_in = ipc.make_socket(ctx, zmq.PULL, e.frontend_in, bind=True)
        self.plans = ipc.make_socket(ctx, zmq.PULL, e.plans[0], bind=False)
        self.results = ipc.make_socket(ctx, zmq.PUSH, e.worker_out, bind=False)
        self.to_scheduler = ipc.make_socket(ctx, zmq.PUSH, e.scheduler_in, bind=False)
        self.proc = SchedulerProcess(self.config, e)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
        self.thread.start()
        ipc.send(self.results, WorkerReady(0, num_kv_blocks, 1024, "cpu"))
        assert isinstance(ipc.recv(self.plans, timeout_ms=10_000), InitKVCache)
        ipc.send(self.results, KVCacheReady(0))
        assert isinstance(self.recv_frontend(), EngineReady)
        self.clock = time.pthread_getcpuclockid(self.thread.ident)

    def _run(self) -> None:
        try:
            self.proc.start()
            self.proc.serve()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def cpu_s(self) -> float:
        return time.clock_gettime(self.clock)

    def recv_frontend(self) -> object:
        """The next message to the frontend that is not a heartbeat."""
        while True:
            msg = ipc.recv(self.frontend_in, timeout_ms=10_000)
            assert msg is not None, f"the scheduler sent the frontend nothing for 10 s (error: {self.error!r})"
            if not isinstance(msg, Ping):
                return msg

    def recv_plan(self) -> StepPlan:
        while True:
            msg = ipc.recv(self.plans, timeout_ms=10_000)
            assert msg is not None, f"no step plan within 10 s (error: {self.error!r})"
            if isinstance(msg, StepPlan) and msg.step_id >= 0:  # step -1 only lists finished ids
                return msg

    def answer(self, plan: StepPlan, token: int = 7) -> None:
        """The result of `plan`: one token per sampling row (every row of these tests samples)."""
        rows = len(plan.new_requests) + len(plan.resumed_requests) + len(plan.decode_seq_ids)
        rows += len(plan.prefill_seq_ids)
        ipc.send(self.results, StepResult(plan.step_id, i32([token] * rows)))

    def cpu_while_holding(self) -> float:
        """CPU seconds the scheduler thread used while the worker sat on its step for HOLD_S."""
        before = self.cpu_s()
        time.sleep(HOLD_S)
        return self.cpu_s() - before

    def close(self) -> None:
        ipc.send(self.to_scheduler, Shutdown("test over"))
        self.thread.join(10)
        self.proc.close()
        for sock in (self.control, self.frontend_in, self.plans, self.results, self.to_scheduler):
            sock.close()
        self.endpoints.cleanup()
        assert self.error is None, self.error


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[callable]:
    made: list[SchedulerHarness] = []

    def make(num_kv_blocks: int = 64, **config: object) -> SchedulerHarness:
        made.append(SchedulerHarness(tmp_path, num_kv_blocks, **config))
        return made[-1]

    yield make
    for h in made:
        h.close()


def test_scheduler_blocks_while_every_running_request_finishes_in_the_step_in_flight(harness) -> None:
    h = harness()
    reqs = [make_request(i, synthetic_prompt(20, i), max_tokens=1) for i in range(4)]
    ipc.send(h.to_scheduler, AddRequests(reqs))
    plan = h.recv_plan()
    assert len(plan.new_requests) == 4
    # One step in flight, room for another, but every request has all its tokens pending: nothing to plan.
    assert h.cpu_while_holding() < MAX_BUSY_CPU_S
    h.answer(plan)
    out = h.recv_frontend()
    assert isinstance(out, StepOutputs) and sorted(f.seq_id for f in out.finished) == [0, 1, 2, 3]
    assert {f.reason for f in out.finished} == {"length"}


def test_scheduler_blocks_while_waiting_requests_do_not_fit(harness) -> None:
    h = harness(num_kv_blocks=4)  # 64 tokens: one 40-token prompt fits, the second waits for its blocks
    reqs = [make_request(i, synthetic_prompt(40, i), max_tokens=2) for i in range(2)]
    ipc.send(h.to_scheduler, AddRequests(reqs))
    prefill, decode = h.recv_plan(), h.recv_plan()  # pipelined: request 0's second token is planned at once
    assert [r.seq_id for r in prefill.new_requests] == [0] and decode.decode_seq_ids.tolist() == [0]
    h.answer(prefill)
    # One step in flight, room for another, request 1 waiting for blocks that only request 0's end frees.
    assert h.cpu_while_holding() < MAX_BUSY_CPU_S
    h.answer(decode)
    plan = h.recv_plan()
    assert [r.seq_id for r in plan.new_requests] == [1] and plan.finished_seq_ids.tolist() == [0]
    h.answer(plan)
    h.answer(h.recv_plan())
    finished = []
    while len(finished) < 2:
        out = h.recv_frontend()
        assert isinstance(out, StepOutputs)
        finished += [f.seq_id for f in out.finished]
    assert sorted(finished) == [0, 1]


def test_idle_scheduler_blocks(harness) -> None:
    h = harness()
    assert h.cpu_while_holding() < MAX_BUSY_CPU_S
