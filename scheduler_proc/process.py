"""The scheduler process: one loop that turns requests and step results into step plans.

Start-up: wait for every worker's `WorkerReady`, size the KV cache to the smallest rank's
capacity, send `InitKVCache`, wait for `KVCacheReady`, then tell the frontend `EngineReady`.

Loop (policy lives in `scheduler.py`, this file only moves messages):
1. take the frontend's `AddRequests` / `AbortSeqs`;
2. take the workers' `StepResult`s, turn them into `StepOutputs` for the frontend, and their
   `GrammarCompiled` answers (structured outputs);
3. send the workers the new grammars to compile (`CompileGrammars`), if any;
4. while fewer than `max_steps_in_flight` steps are outstanding, plan one and send it to every
   rank. A line of timing per step goes to the log at DEBUG level.
Then it blocks on its sockets: once step 4 has planned all it can, nothing new can be planned
before a message arrives, whatever the state (steps in flight, requests finishing, waiting
requests that do not fit yet).
Every second, busy or idle, it also pings the frontend, which takes a scheduler silent for
DELTASERVE_SCHEDULER_TIMEOUT_S for a stopped or stuck one; the frontend pings it back the same way,
and a frontend silent for DELTASERVE_FRONTEND_TIMEOUT_S ends the engine.
"""

from __future__ import annotations

import logging
import time

import zmq

from common import envs, ipc
from common.config import EngineConfig
from common.errors import ExplainedError
from common.proc import StepLog, engine_process_main, torch_threads, trim_heap
from common.profiling import SchedulerProfiling, run_id_of
from common.protocol import (
    AbortSeqs,
    AddRequests,
    EngineReady,
    FinishedSeq,
    GrammarCompiled,
    InitKVCache,
    KVCacheReady,
    Ping,
    ProcessFailed,
    ProcessReady,
    ProfileStop,
    ProtocolError,
    Shutdown,
    StartProfile,
    StepOutputs,
    StepPlan,
    StepResult,
    StopProfile,
    WorkerReady,
    decode,
    encode,
)
from common.units import count
from scheduler_proc.scheduler import Scheduler, SchedulerConfig
from scheduler_proc.watchdog import StepShape, StepWatchdog

log = logging.getLogger("deltaserve.scheduler")
HEARTBEAT_S = 2.0  # an idle scheduler pings the workers this often
FRONTEND_HEARTBEAT_S = 1.0  # the scheduler pings the frontend this often, busy or idle (DELTASERVE_SCHEDULER_TIMEOUT_S)


class SchedulerProcess:
    def __init__(self, config: EngineConfig, endpoints: ipc.Endpoints) -> None:
        self.config = config
        self.endpoints = endpoints
        self.ctx = zmq.Context.instance()
        self.control = endpoints.make_socket(self.ctx, zmq.PUSH, endpoints.control, bind=False)
        self.from_frontend = endpoints.make_socket(self.ctx, zmq.PULL, endpoints.scheduler_in, bind=True)
        self.from_workers = endpoints.make_socket(self.ctx, zmq.PULL, endpoints.worker_out, bind=True)
        self.to_workers = [endpoints.make_socket(self.ctx, zmq.PUSH, a, bind=True) for a in endpoints.plans]
        self.to_frontend = endpoints.make_socket(self.ctx, zmq.PUSH, endpoints.frontend_in, bind=False)
        self.scheduler: Scheduler | None = None
        self.step_started: dict[int, float] = {}
        # The last step result handled: (its step id, perf_counter when it arrived, ms to process and forward it),
        # written beside the next plan in the step log (the host chain from a step's end to the plan after next).
        self.last_result: tuple[int, float, float] = (-1, 0.0, 0.0)
        self.step_timeout_s = envs.step_timeout_s()  # its CPU default once the workers say where they run
        self.watchdog = StepWatchdog(self.step_timeout_s, envs.step_timeout_floor_s())
        self.check_invariants = envs.check_invariants()
        self.step_log = StepLog("scheduler")
        self.profiling = SchedulerProfiling(config, run_id_of(endpoints.run_dir), self._send_workers,
                                            lambda msg: ipc.send(self.to_frontend, msg))
        self.phases = self.profiling.phases

    # ------------------------------------------------------------------ start-up
    def start(self) -> None:
        tp = self.config.tensor_parallel_size
        ready: dict[int, WorkerReady] = {}
        while len(ready) < tp:
            msg = self._recv_worker()
            if isinstance(msg, WorkerReady):
                ready[msg.rank] = msg
        self.step_timeout_s = envs.step_timeout_s(on_cpu=any(r.device == "cpu" for r in ready.values()))
        self.watchdog = StepWatchdog(self.step_timeout_s, envs.step_timeout_floor_s())
        num_blocks = min(r.max_num_kv_blocks for r in ready.values())
        if num_blocks <= 0:
            raise ExplainedError(
                "no memory is left for the KV cache after loading the model "
                f"(ranks report {[r.max_num_kv_blocks for r in ready.values()]} blocks); "
                "raise --gpu-memory-utilization or set --num-kvcache-blocks")
        for sock in self.to_workers:
            ipc.send(sock, InitKVCache(num_blocks))
        done: set[int] = set()
        while len(done) < tp:
            msg = self._recv_worker()
            if isinstance(msg, KVCacheReady):
                done.add(msg.rank)
        cfg = self.config
        assert cfg.max_model_len is not None
        self.scheduler = Scheduler(SchedulerConfig(
            num_kv_blocks=num_blocks,
            block_size=cfg.block_size,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_prefix_caching=cfg.enable_prefix_caching,
            vocab_size=cfg.vocab_size,
            num_ranks=cfg.tensor_parallel_size,
            max_steps_in_flight=cfg.max_steps_in_flight,
        ))
        warning = ""
        capacity = num_blocks * cfg.block_size
        if capacity < cfg.max_model_len:
            warning = (f"the KV cache holds {count(capacity, 'token')} ({count(num_blocks, 'block')}), fewer than "
                       f"max_model_len "
                       f"{cfg.max_model_len}: longer requests stop with finish reason 'length'")
            log.warning(warning)
        info = {"kv_bytes_per_block": ready[0].kv_bytes_per_block, "devices": [ready[r].device for r in sorted(ready)],
                "step_timeout_s": self.step_timeout_s, "step_timeout_floor_s": self.watchdog.floor_s,
                "warning": warning}
        ipc.send(self.to_frontend, EngineReady(num_blocks, cfg.block_size, info))
        ipc.send(self.control, ProcessReady("scheduler", {"num_kv_blocks": num_blocks,
                                                          "torch_threads": torch_threads()}))
        log.info("scheduler ready: %d KV blocks of %d tokens", num_blocks, cfg.block_size)

    def _recv_worker(self) -> object:
        return self._worker_message(self.from_workers.recv())

    @staticmethod
    def _worker_message(raw: bytes) -> object:
        """A worker's message; a worker's failure report ends the scheduler with its reason (the worker
        logged its own traceback, if any)."""
        msg = decode(raw)  # workers are ours: a malformed message is a fatal bug
        if isinstance(msg, ProcessFailed):
            raise ExplainedError(f"{msg.name} failed: {msg.error}")
        return msg

    # ------------------------------------------------------------------ serving
    def serve(self) -> None:
        sched = self.scheduler
        assert sched is not None
        poller = zmq.Poller()
        poller.register(self.from_frontend, zmq.POLLIN)
        poller.register(self.from_workers, zmq.POLLIN)
        self.last_sent = time.monotonic()
        next_beat = time.monotonic()
        frontend_timeout_s = envs.frontend_timeout_s()
        frontend_last_heard = time.monotonic()
        while True:
            if time.monotonic() >= next_beat:  # the frontend takes a silent scheduler for a stopped one
                ipc.send(self.to_frontend, Ping())
                next_beat = time.monotonic() + FRONTEND_HEARTBEAT_S
                if not sched.num_unfinished:
                    trim_heap()
            # Block until a message comes (or the next heartbeat is due). The planning loop below ran to
            # its end last time round, so nothing can be planned before a request, an abort or a step
            # result arrives: polling here without a timeout would spin a core (and take it from the
            # workers on CPU) while steps are in flight, waiting requests do not fit or requests finish.
            events = dict(poller.poll(max(1, int((next_beat - time.monotonic()) * 1000))))
            if self.from_frontend in events:
                for raw in ipc.recv_all(self.from_frontend):
                    self.phases.begin("receive")
                    if self._handle_frontend(raw):
                        return
                self.phases.end()
                frontend_last_heard = time.monotonic()
            silent = time.monotonic() - frontend_last_heard
            if frontend_timeout_s and silent > frontend_timeout_s:  # the launcher cannot see a stopped frontend
                raise ExplainedError(
                    f"the frontend has sent nothing for {silent:.0f} s (DELTASERVE_FRONTEND_TIMEOUT_S="
                    f"{frontend_timeout_s:g}): it is stopped or stuck, and the engine is shutting down")
            if self.from_workers in events:
                for raw in ipc.recv_all(self.from_workers):
                    self._handle_worker(raw)
            work = sched.take_grammar_work()  # before any plan that could name those grammars
            if work is not None:
                self._send_workers(work)
            while sched.can_schedule():
                self.profiling.before_step(sched.next_step_id, sched.num_unfinished > 0)
                t0 = time.perf_counter()
                self.phases.begin("schedule", sched.next_step_id)
                plan = sched.schedule()
                if plan is None:
                    self.phases.end()
                    break
                self._send_plan(plan, t0)
                if self.check_invariants:
                    sched.check_invariants()
            finished = sched.take_finished()
            if finished:
                self._send_outputs(StepOutputs(step_id=-1, finished=finished))
            self._check_progress()
            if time.monotonic() - self.last_sent > HEARTBEAT_S:  # idle: tell workers started elsewhere we live
                for sock in self.to_workers:
                    ipc.send(sock, Ping())
                self.last_sent = time.monotonic()

    def _check_progress(self) -> None:
        """Raise `ExplainedError` if the oldest unfinished step has run past its bound (`watchdog.py`).

        A worker that stops making progress without exiting (SIGSTOP, a hung device, a peer that died
        inside a collective whose kernel now waits forever) would otherwise leave every request
        waiting forever; the raised error ends the scheduler, and the launcher takes the engine down
        with this message.
        """
        stuck = self.watchdog.stuck(time.monotonic())
        if stuck is None:
            return
        if stuck.after_profiling:
            why = (f"DELTASERVE_STEP_TIMEOUT_S={self.step_timeout_s:g} for the first step after a profiling session, "
                   "which waits for the workers to write their traces")
        elif stuck.longest_s is None:
            why = f"DELTASERVE_STEP_TIMEOUT_S={self.step_timeout_s:g} for a step unlike any measured so far"
        elif stuck.bound_s >= self.step_timeout_s:  # the cap decided, whatever was measured
            why = f"DELTASERVE_STEP_TIMEOUT_S={self.step_timeout_s:g}, the most any step may take"
        elif stuck.work_ratio > 1:
            why = (f"{self.watchdog.factor:g} times {stuck.work_ratio:g} times the longest step of a smaller shape, "
                   f"{stuck.longest_s:.3g} s, for a shape not measured before (its tokens times context up to "
                   f"{stuck.work_ratio:g} times that one's), at least DELTASERVE_STEP_TIMEOUT_FLOOR_S="
                   f"{self.watchdog.floor_s:g}")
        else:
            why = (f"{self.watchdog.factor:g} times the longest step like it so far, {stuck.longest_s:.3g} s, "
                   f"at least DELTASERVE_STEP_TIMEOUT_FLOOR_S={self.watchdog.floor_s:g}")
        raise ExplainedError(
            f"step {stuck.step_id} has not finished after {stuck.waited_s:.0f} s "
            f"(its bound is {round(stuck.bound_s, 1):g} s: {why}): a worker is stuck (a stopped process, a hung "
            "device, or a peer lost inside a collective)")

    def _handle_frontend(self, raw: bytes) -> bool:
        """Apply one frontend message; return True on shutdown."""
        sched = self.scheduler
        assert sched is not None
        try:
            msg = decode(raw)
        except ProtocolError as exc:
            log.error("dropped a malformed message from the frontend: %s", exc)
            return False
        if isinstance(msg, AddRequests):
            errors: list[FinishedSeq] = []
            for req in msg.requests:
                errors.extend(sched.add_request(req))
            if errors:
                self._send_outputs(StepOutputs(step_id=-1, finished=errors))
        elif isinstance(msg, AbortSeqs):
            finished = sched.abort(msg.seq_ids)
            if finished:
                self._send_outputs(StepOutputs(step_id=-1, finished=finished))
        elif isinstance(msg, Shutdown):
            return True  # close() says goodbye to the workers
        elif isinstance(msg, Ping):  # the frontend's heartbeat
            pass
        elif isinstance(msg, (StartProfile, StopProfile)):
            self.profiling.request(msg, sched.next_step_id, bool(sched.in_flight))
        else:
            log.error("unexpected %s from the frontend", type(msg).__name__)
        return False

    def _handle_worker(self, raw: bytes) -> None:
        sched = self.scheduler
        assert sched is not None
        t_in = time.perf_counter()
        msg = self._worker_message(raw)
        if isinstance(msg, GrammarCompiled):
            log.debug("rank %d compiled grammar %d in %.3f s%s", msg.rank, msg.grammar_id, msg.compile_s,
                      f": {msg.error}" if msg.error else "")
            finished = sched.grammar_compiled(msg)
            if finished:
                self._send_outputs(StepOutputs(step_id=-1, finished=finished))
            return
        if not isinstance(msg, StepResult):
            log.error("unexpected %s from a worker", type(msg).__name__)
            return
        t0 = time.perf_counter()
        self.phases.begin("process result", msg.step_id)
        self.watchdog.finished(msg.step_id, time.monotonic())
        outputs = sched.process_result(msg)
        self._send_outputs(outputs)
        self.phases.end()
        self.last_result = (msg.step_id, t_in, (time.perf_counter() - t_in) * 1e3)
        self.profiling.after_result(msg.step_id)
        if self.check_invariants:
            sched.check_invariants()
        if log.isEnabledFor(logging.DEBUG):
            started = self.step_started.pop(msg.step_id, t0)
            worker = " ".join(f"{k} {float(v):.2f}" for k, v in msg.timings.items())
            log.debug("step %d done: %d tokens out, %d finished, round trip %.2f ms, result %.3f ms | worker ms: %s",
                      msg.step_id, len(outputs.token_ids), len(outputs.finished), (t0 - started) * 1e3,
                      (time.perf_counter() - t0) * 1e3, worker)

    def _send_outputs(self, outputs: StepOutputs) -> None:
        """Send `outputs` to the frontend with the scheduler's state as it is now (for its metrics)."""
        assert self.scheduler is not None
        outputs.stats = self.scheduler.stats()
        ipc.send(self.to_frontend, outputs)

    def _send_plan(self, plan: StepPlan, t0: float) -> None:
        sched = self.scheduler
        assert sched is not None
        self.phases.begin("encode", plan.step_id)
        data = encode(plan)
        t1 = time.perf_counter()
        self.phases.begin("send", plan.step_id)
        for sock in self.to_workers:
            sock.send(data, copy=False)
        self.phases.end()
        self.profiling.after_plan(plan.step_id)
        self.last_sent = time.monotonic()
        if plan.step_id >= 0 and self.watchdog.unseen_s:  # step -1 only says what finished: nothing answers it
            seqs = sched.seqs
            self.watchdog.sent(plan.step_id, StepShape.of(plan, lambda i: seqs[i].num_computed_tokens), self.last_sent)
        if self.step_log.enabled:
            self.step_log.write({
                "step": plan.step_id, "t_sent": t1, "schedule_ms": (t1 - t0) * 1e3, "plan_bytes": len(data),
                "new": len(plan.new_requests), "resumed": len(plan.resumed_requests),
                "prefill_chunks": len(plan.prefill_seq_ids), "decodes": len(plan.decode_seq_ids),
                "preempted": len(plan.preempted_seq_ids), "finished": len(plan.finished_seq_ids),
                "waiting": len(sched.waiting), "running": len(sched.running),
                "free_blocks": sched.block_manager.num_free_blocks, "after_result": self.last_result[0],
                "t_result": self.last_result[1], "result_ms": self.last_result[2]})
        if log.isEnabledFor(logging.DEBUG):
            self.step_started[plan.step_id] = t1
            log.debug("step %d planned: %d new, %d resumed, %d prefill chunks, %d decodes, %d preempted, "
                      "%d finished | schedule %.3f ms, plan %d bytes | waiting %d running %d free blocks %d",
                      plan.step_id, len(plan.new_requests), len(plan.resumed_requests), len(plan.prefill_seq_ids),
                      len(plan.decode_seq_ids), len(plan.preempted_seq_ids), len(plan.finished_seq_ids),
                      (t1 - t0) * 1e3, len(data), len(sched.waiting), len(sched.running),
                      sched.block_manager.num_free_blocks)

    def _send_workers(self, msg: object) -> None:
        if isinstance(msg, ProfileStop):  # the workers write their traces after its last step
            self.watchdog.excuse_after(msg.last_step)
        for sock in self.to_workers:
            ipc.send(sock, msg)

    def close(self) -> None:
        self.profiling.close()
        goodbye = encode(Shutdown("scheduler stopped"))
        for sock in self.to_workers:  # best effort: lets workers started elsewhere exit at once
            sock.setsockopt(zmq.LINGER, 500)
            try:
                sock.send(goodbye, zmq.NOBLOCK)  # a bound PUSH socket with no worker left would block
            except zmq.Again:
                pass
        for sock in [self.control, self.from_frontend, self.from_workers, self.to_frontend, *self.to_workers]:
            sock.close()
        self.step_log.close()


def main(argv: list[str] | None = None) -> None:
    engine_process_main("scheduler", "scheduler_proc", "deltaserve scheduler process (started by launch.py)",
                        lambda config, endpoints, args: SchedulerProcess(config, endpoints), argv)
