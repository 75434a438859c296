"""A worker process: one per device (tensor-parallel rank). One loop, top to bottom:

receive a step plan -> apply it and launch the step on the device -> finalize the previous step
(its sampled tokens reach the host) -> rank 0 sends them to the scheduler.

Launching step N+1 before finalizing step N keeps the device busy while the scheduler plans
ahead. When no plan is waiting and the launched step has completed, it is finalized at once.

`CompileGrammars` messages (structured outputs) are handed to the compile thread
(workers/structured_output.py), which answers the scheduler on a socket of its own.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque

import zmq

from common import envs, ipc
from common.config import EngineConfig
from common.errors import ExplainedError
from common.proc import StepLog, engine_process_main, torch_threads, trim_heap
from common.profiling import WorkerProfiling, run_id_of
from common.protocol import (
    CompileGrammars,
    GrammarCompiled,
    InitKVCache,
    KVCacheReady,
    Ping,
    ProcessReady,
    ProfileStart,
    ProfileStop,
    Shutdown,
    StepPlan,
    StepResult,
    WorkerReady,
    i32,
)
from workers.compile_watch import CompileWatch
from workers.loader import resolve_device
from workers.model_runner import ModelRunner, PendingStep
from workers.parallel import destroy_tensor_parallel, peer_loss_explained

log = logging.getLogger("deltaserve.worker")
SCHEDULER_SILENCE_S = 15.0  # a worker started by hand exits when the scheduler is silent this long


# torch threads of a GPU worker. Its own CPU work is small: each step's inputs (numpy, and tensors far below the
# 32,768 elements from which torch splits an op over threads) and the grammar masks (xgrammar and llguidance fill
# them on threads of their own). More threads would only wait on cores that the scheduler, the frontend and the
# other ranks need, for the few host ops that split: one is enough.
GPU_WORKER_THREADS = 1


def cores_given() -> int:
    """The CPUs this process may run on (`os.sched_getaffinity`: a container's or `taskset`'s share, not the
    host's count, which torch's default follows); os.cpu_count() where affinity is unknown (not Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def worker_torch_threads(device_type: str, tp: int) -> int:
    """torch's intra-op threads for a worker on `device_type` ("cpu" or "cuda") among `tp` tensor-parallel ranks:
    DELTASERVE_WORKER_THREADS when set; else OMP_NUM_THREADS when set (a user's choice before that variable
    existed); else, on CPU, the cores given to this process divided among the `tp` ranks, at least 1 (every rank
    taking every core made tensor parallelism on CPU 5.6x slower); on a GPU, `GPU_WORKER_THREADS`."""
    chosen = envs.worker_threads() or envs.omp_num_threads()
    if chosen is not None:
        return chosen
    return max(1, cores_given() // max(1, tp)) if device_type == "cpu" else GPU_WORKER_THREADS


class WorkerProcess:
    def __init__(self, config: EngineConfig, endpoints: ipc.Endpoints, rank: int, external: bool = False) -> None:
        self.config = config
        self.rank = rank
        self.external = external  # started by hand (no launcher parent): watch the scheduler's heartbeat
        self.ctx = zmq.Context.instance()
        self.control = endpoints.make_socket(self.ctx, zmq.PUSH, endpoints.control, bind=False)
        self.plans = endpoints.make_socket(self.ctx, zmq.PULL, endpoints.plans[rank], bind=False)
        self.results = endpoints.make_socket(self.ctx, zmq.PUSH, endpoints.worker_out, bind=False)
        self.endpoints = endpoints
        self._grammar_results: zmq.Socket | None = None  # made, used (and closed) by the compile thread only
        self.runner = ModelRunner(config, rank, endpoints.dist_init, endpoints.listen_fds.get(endpoints.dist_init, -1),
                                  report_grammar=self._report_grammar)
        self.step_log = StepLog(f"worker-tp{rank}")
        device = str(resolve_device(config.device, rank))
        self.profiling = WorkerProfiling(config, run_id_of(endpoints.run_dir), rank, device)
        self.runner.phases = self.profiling.phases
        self.compile_watch = CompileWatch()  # from the end of the warm-up on: any Triton compile is a stall
        self._pending: deque[PendingStep] = deque()  # launched, their results not sent yet, oldest first
        # After a launch, the older steps left pending: with the scheduler `max_steps_in_flight` ahead, the oldest of
        # them is sent as soon as its tokens arrive (2: step N right after N+1's launch, as the plan of N+2 needs it).
        self.keep_pending = max(0, config.max_steps_in_flight - 2)

    def start(self) -> None:
        r = self.runner
        if r.device.type == "cuda":  # built while the KV cache, the graphs and the kernels are being made
            r.structured.preload()
        ipc.send(self.results, WorkerReady(self.rank, r.max_num_kv_blocks(), r.kv_bytes_per_block, r.device_name()))
        msg = ipc.recv(self.plans)
        if isinstance(msg, Shutdown):
            raise SystemExit(0)
        assert isinstance(msg, InitKVCache), f"expected InitKVCache, got {type(msg).__name__}"
        with peer_loss_explained():
            r.allocate_kv_cache(msg.num_kv_blocks)
            r.capture_cuda_graphs()
            r.compile_sampling()
            r.compile_attention()
        self.compile_watch.install()
        ipc.send(self.results, KVCacheReady(self.rank, {"graphs": len(r.cuda_graphs.graphs)}))
        ipc.send(self.control, ProcessReady(f"worker-tp{self.rank}", {"device": r.device_name(),
                                                                      "torch_threads": torch_threads()}))

    def _report_grammar(self, msg: GrammarCompiled) -> None:
        """Called from the compile thread: ZeroMQ sockets are not thread-safe, so it sends on its own."""
        if self._grammar_results is None:
            self._grammar_results = self.endpoints.make_socket(self.ctx, zmq.PUSH, self.endpoints.worker_out,
                                                               bind=False)
        ipc.send(self._grammar_results, msg)

    def serve(self) -> None:
        with peer_loss_explained():  # a rank that died: the survivors report a consequence, the launcher names it
            self._serve_steps()

    def _serve_steps(self) -> None:
        self.runner.on_previous_received = self._send_pending
        last_heard = time.monotonic()
        pending = self._pending
        while True:
            if pending and not self.plans.poll(0):
                if pending[0].ready():
                    self._finish(pending.popleft())
                else:
                    self.plans.poll(0.05)  # milliseconds; wakes early when a plan arrives
                continue
            msg = ipc.recv(self.plans, timeout_ms=1000)
            if msg is None:  # a second without a plan: idle
                trim_heap()
                if self.external and time.monotonic() - last_heard > SCHEDULER_SILENCE_S:
                    raise ExplainedError(f"no word from the scheduler for {SCHEDULER_SILENCE_S:.0f} s: it is gone")
                continue
            last_heard = time.monotonic()
            if isinstance(msg, Ping):
                continue
            if isinstance(msg, (ProfileStart, ProfileStop)):
                self.profiling.control(msg, pending[0].step_id if pending else None)
                continue
            if isinstance(msg, CompileGrammars):
                self.runner.structured.compile(msg)
                continue
            if isinstance(msg, Shutdown):
                self._send_pending()
                return
            assert isinstance(msg, StepPlan), f"expected StepPlan, got {type(msg).__name__}"
            if pending and pending[-1].event is None:  # computed in full by execute (CPU): running the next
                self._send_pending()  # step before sending it would hold its tokens back a whole step
            # None for a plan with no rows (only finished ids). A step with constrained rows sends the pending
            # steps' results itself, once it has their tokens (ModelRunner.on_previous_received).
            launched = self.runner.execute(msg)
            compiles = self.compile_watch.take()
            if launched is not None and compiles:
                launched.timings["compiles"] = compiles
            self._send_pending(keep=self.keep_pending)
            if launched is not None:
                pending.append(launched)

    def _send_pending(self, keep: int = 0) -> None:
        """Finish the launched steps whose results are not sent yet (`_finish`), oldest first, until `keep` are
        left, and forget them."""
        while len(self._pending) > keep:
            self._finish(self._pending.popleft())

    def _finish(self, step: PendingStep) -> None:
        self.profiling.phases.begin("wait", step.step_id)
        t0 = time.perf_counter()
        tokens = self.runner.finalize(step)
        t1 = time.perf_counter()
        step.timings["wait_ms"] = (t1 - t0) * 1e3
        step.timings["t_done"] = t1  # time.perf_counter() is one clock for every process of the host
        self.profiling.phases.begin("send result", step.step_id)
        if self.rank == 0:
            ipc.send(self.results, StepResult(step.step_id, i32(tokens), step.timings, step.logprobs,
                                              step.prompt_logprobs, step.failed, i32(step.grammar_incomplete)))
        t_sent = time.perf_counter()
        self.profiling.phases.end()
        self.profiling.step_done(step.step_id, step.timings)
        if self.step_log.enabled:
            self.step_log.write({"step": step.step_id, **step.timings, "t_result_sent": t_sent})
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: %s", step.step_id, " ".join(f"{k} {float(v):.2f}" for k, v in step.timings.items()))

    def close(self) -> None:
        self.compile_watch.uninstall()
        self.runner.structured.close()
        if self._grammar_results is not None and self.runner.structured.idle:
            self._grammar_results.close()
        for sock in (self.control, self.plans, self.results):
            sock.close()
        self.step_log.close()
        self.profiling.close()
        destroy_tensor_parallel()


def main(argv: list[str] | None = None) -> None:
    engine_process_main(
        "worker", "workers", "deltaserve worker process (one per device / tensor-parallel rank)",
        lambda config, endpoints, args: WorkerProcess(config, endpoints, args.rank, external=args.parent_pid is None),
        argv, with_rank=True,
        threads_of=lambda config, args: worker_torch_threads(resolve_device(config.device, args.rank).type,
                                                             config.tensor_parallel_size))
