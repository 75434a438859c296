"""Profiling runs: the phases of every process's loop, a torch.profiler trace per process, and the
sessions that start and stop them on every process at the same step.

- `PhaseRecorder`: a loop marks its phases, `phases.begin("schedule", step)` ... `phases.end()` (a
  `begin` ends the phase before it). Outside a session a mark is one method call that returns at once.
  In a session each phase is kept as (name, step, start ns, end ns) on `time.perf_counter_ns()`
  (CLOCK_MONOTONIC on Linux: one clock for every process of a host) and mirrored as a
  `torch.profiler.record_function` range named "<phase> [step N]", so that it shows in the process's
  torch trace around the ops, CUDA runtime calls and kernels it caused.
- `ProcessProfiler`: one `torch.profiler.profile` per session (CPU activity, plus CUDA on a GPU worker).
  When the session stops it writes `<folder>/<process>.pt.trace.json.gz` (Kineto's Chrome trace, which
  Perfetto, chrome://tracing and TensorBoard open) and then `<folder>/<process>.phases.json` (the phases,
  the workers' step timings, and the clock facts `common.timeline` needs to put the trace on the shared
  clock). The phases file is written last: its presence means the process is done.
- Sessions, one class per kind of process: `SchedulerProfiling` decides (it numbers the steps),
  `WorkerProfiling` and `FrontendProfiling` follow its `ProfileStart` / `ProfileStop` messages.

A session starts by itself when the first step of `profile_steps` ("A:B", steps A..B-1) is planned, and
clients start more (`StartProfile`) and stop them (`StopProfile`) while the engine serves. Session 1
writes into `profile_dir` itself, session k > 1 into `profile_dir/session-k/`. When a session ends the
frontend merges its files (`python -m common.timeline`, in a child process: serving goes on) into
`timeline.json.gz` and `summary.txt`; a session cut short by the engine's shutdown is merged by the
launcher once every process has exited.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from common import envs
from common.config import DEFAULT_PROFILE_STEPS, MAX_PROFILE_STEPS, EngineConfig, parse_profile_steps
from common.protocol import ProfileStart, ProfileStatus, ProfileStop, StartProfile, StopProfile
from common.units import count

log = logging.getLogger("deltaserve.profiling")
PHASES_FORMAT = "deltaserve-phases/1"
MAX_PHASES = 1_000_000  # per process and session (~100 MB): past it, phases are dropped and the file says so
MERGE_WAIT_S = 60.0  # how long a merge waits for the files of processes that are still writing theirs


KINETO_MARKER = b"USDT:"  # how kineto's lines for user-space tracing probes begin


@contextlib.contextmanager
def kineto_markers_dropped() -> Iterator[None]:
    """Run the body with this process's stderr (file descriptor 2) captured, then write back every line captured but
    kineto's "USDT:" markers, in order.

    torch's kineto (torch 2.13) writes "USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start"
    (and profiler_stop) to stderr at every trace start and stop, in every profiled process. It logs them at its
    highest level (USDT, above ERROR), so that KINETO_LOG_LEVEL hides them only with kineto's own errors (a CUPTI
    that cannot trace the GPU, say), which are kept here. What other threads write meanwhile is held back until the
    body ends (a start takes up to ~2 s, the first one).
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = memoryview(b"".join(line for line in captured if not line.startswith(KINETO_MARKER)))
            while kept:
                kept = kept[os.write(2, kept):]


def session_folder(profile_dir: str, session: int) -> str:
    """Where session `session` (1, 2, ...) writes: `profile_dir` itself for the first, `session-k/` below it after."""
    return profile_dir if session == 1 else os.path.join(profile_dir, f"session-{session}")


def run_id_of(run_dir: str) -> str:
    """The name of one launch (its socket folder's name), written into every file of its sessions so
    that a merge never mixes in files an earlier run left in the same folder."""
    return os.path.basename(run_dir.rstrip("/")) or "run"


def clock_offset_ns() -> int:
    """`time.time_ns() - time.perf_counter_ns()` now: what turns a Unix time (torch.profiler's clock)
    into this host's monotonic clock. The smallest of a few reads (a read interrupted between the two
    clocks only ever widens the difference)."""
    best = None
    for _ in range(5):
        a = time.perf_counter_ns()
        unix = time.time_ns()
        b = time.perf_counter_ns()
        if best is None or b - a < best[0]:
            best = (b - a, unix - (a + b) // 2)
    assert best is not None
    return best[1]


class PhaseRecorder:
    """The phases of one process's loop during a session (see the module docstring)."""

    def __init__(self) -> None:
        self.recording = False
        self.phases: list[tuple[str, int, int, int]] = []  # (name, step or -1, start ns, end ns), in time order
        self.dropped = 0  # phases not kept past MAX_PHASES
        # The session's last step once it is known: a worker launches step N+1 before it finishes step N,
        # so phases of steps past the last can begin while the session still waits for its last step.
        self.last_step: int | None = None
        self._open: tuple[str, int, int] | None = None
        self._range: Any = None  # the record_function of the open phase
        self._record_function: Any = None

    def begin(self, name: str, step: int = -1) -> None:
        """Start phase `name` of step `step` (-1: not tied to a step), ending the open one."""
        if not self.recording:
            return
        if self._open is not None:
            self._close()
        if self.last_step is not None and step > self.last_step:
            return  # a later step's work: not part of this session
        # Our stamps lie inside the torch range: a phase's time is its code's, not the profiler's.
        self._range = self._record_function(f"{name} [step {step}]" if step >= 0 else name)
        self._range.__enter__()
        self._open = (name, step, time.perf_counter_ns())

    @property
    def current(self) -> tuple[str, int] | None:
        """(name, step) of the open phase, or None."""
        return None if self._open is None else self._open[:2]

    def end(self) -> None:
        """End the open phase, if any."""
        if self.recording and self._open is not None:
            self._close()

    def _close(self) -> None:
        now = time.perf_counter_ns()
        self._range.__exit__(None, None, None)
        name, step, start = self._open  # type: ignore[misc]
        self._open = self._range = None
        if len(self.phases) < MAX_PHASES:
            self.phases.append((name, step, start, now))
        else:
            self.dropped += 1

    def start(self, record_function: Any) -> None:
        self.phases, self.dropped, self._open, self.last_step = [], 0, None, None
        self._record_function = record_function
        self.recording = True

    def stop(self) -> None:
        self.end()
        self.recording = False


class ProcessProfiler:
    """The profiling sessions of one process: off for good when `profile_dir` is None.

    `device`: "cpu", or "cuda:N" for a GPU worker (its trace then holds CUDA activity too). With
    profiling on, torch is imported and its profiler started once at construction: the first start
    takes seconds (1.7 s on CPU here) and the first ranges a millisecond each, which must not stall or
    stretch the first traced step.
    """

    def __init__(self, name: str, profile_dir: str | None, run_id: str, device: str = "cpu") -> None:
        self.name = name
        self.enabled = profile_dir is not None
        self.run_id = run_id
        self.device = device
        self.phases = PhaseRecorder()
        self.session: ProfileStart | None = None
        self.steps: dict[int, dict[str, Any]] = {}  # a worker's step timings (as in the step log), by step id
        self._profile: Any = None
        self._started: tuple[int, int] = (0, 0)  # perf_counter_ns and clock_offset_ns at start
        if self.enabled:
            import torch.profiler

            with kineto_markers_dropped():
                self._new_profile().start()
                for _ in range(3):  # the first ranges cost a millisecond each (their Python code warming up)
                    with torch.profiler.record_function("warm-up"):
                        pass
                self._profile.stop()
            self._profile = None

    @property
    def recording(self) -> bool:
        return self.session is not None

    def _new_profile(self) -> Any:
        import torch.profiler

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities, with_stack=envs.profile_with_stack())
        return self._profile

    def start(self, msg: ProfileStart) -> None:
        """Start session `msg.session` now (a session still open is stopped and written first)."""
        if not self.enabled:
            return
        if self.session is not None:
            self.stop()
        import torch.profiler

        try:
            os.makedirs(msg.folder, exist_ok=True)
        except OSError as exc:  # the scheduler made it: it was removed or replaced since; this process sits it out
            log.error("%s: profiling session %d is not recorded here: cannot create %s: %s", self.name, msg.session,
                      msg.folder, exc.strerror or exc)
            return
        self.session, self.steps = msg, {}
        with kineto_markers_dropped():
            self._new_profile().start()
        self._started = (time.perf_counter_ns(), clock_offset_ns())
        self.phases.start(torch.profiler.record_function)

    def record_step(self, step_id: int, timings: dict[str, Any]) -> None:
        """Keep a worker's timings of a finished step (its step-log line) for the summary."""
        if self.session is not None:
            self.steps[step_id] = dict(timings)

    def stop(self, last_step: int | None = None, complete: bool = True) -> str | None:
        """End the session and write its two files; returns the phases file's path (None if no session).
        `last_step`: the session's last step (default: the last one this process saw);
        `complete=False`: cut short (the process is exiting), said so in the file."""
        msg = self.session
        if msg is None:
            return None
        self.phases.stop()
        stopped = (time.perf_counter_ns(), clock_offset_ns())
        with kineto_markers_dropped():
            self._profile.stop()
        self.session = None
        trace = os.path.join(msg.folder, f"{self.name}.pt.trace.json.gz")
        try:
            write_trace(self._profile, trace)
        except Exception as exc:  # a trace that cannot be written must not take the engine down
            log.error("%s: could not write %s: %s: %s", self.name, trace, type(exc).__name__, exc)
            trace = ""
        self._profile = None
        steps = [step for _, step, _, _ in self.phases.phases if step >= 0]
        record = {
            "format": PHASES_FORMAT, "process": self.name, "pid": os.getpid(), "run": self.run_id,
            "session": msg.session, "first_step": msg.first_step,
            "last_step": last_step if last_step is not None else max(steps, default=msg.first_step - 1),
            "planned_last_step": msg.last_step, "complete": complete, "device": self.device,
            "clock": "time.perf_counter_ns (CLOCK_MONOTONIC)", "start_ns": self._started[0], "stop_ns": stopped[0],
            "unix_minus_monotonic_ns": [self._started[1], stopped[1]],
            "trace": os.path.basename(trace) if trace else None, "dropped_phases": self.phases.dropped,
            "phases": self.phases.phases, "steps": {str(k): v for k, v in self.steps.items()},
        }
        path = os.path.join(msg.folder, f"{self.name}.phases.json")
        self.phases.phases, self.steps = [], {}
        try:
            write_atomically(path, json.dumps(record).encode())
        except OSError as exc:  # the folder was removed or filled: a lost trace must not take the engine down
            log.error("%s: could not write %s: %s", self.name, path, exc.strerror or exc)
            return None
        return path

    def close(self) -> None:
        """At exit: write the open session, cut short."""
        if self.session is not None:
            self.stop(complete=False)


def write_atomically(path: str, data: bytes) -> None:
    """Write `data` to `path` whole or not at all (a reader never sees half a file)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_trace(profile: Any, path: str) -> None:
    """Export a stopped torch.profiler session as gzipped Chrome trace JSON to `path`, atomically.
    Compressed at level 1: on 51 MB of kernel events it took 1.1 s for 4.4 MB, where torch's level 9
    took 8.5 s for 3.4 MB, and the process serves nobody meanwhile."""
    import gzip
    import shutil

    raw = f"{path}.{os.getpid()}.json"
    try:
        profile.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(f"{path}.{os.getpid()}.tmp", "wb", compresslevel=1) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(f"{path}.{os.getpid()}.tmp", path)
    finally:
        if os.path.exists(raw):
            os.unlink(raw)


def process_names(config: EngineConfig) -> list[str]:
    """Every process that writes files in a session, in the merged timeline's order."""
    return ["frontend", "scheduler", *(f"worker-tp{r}" for r in range(config.tensor_parallel_size))]


def window_length(config: EngineConfig) -> int:
    """Steps a client's `StartProfile(num_steps=0)` traces: as many as the `profile_steps` window holds."""
    window = parse_profile_steps(config.profile_steps) or parse_profile_steps(DEFAULT_PROFILE_STEPS)
    assert window is not None
    return window[1] - window[0]


# ============================================================================ the scheduler decides
class SchedulerProfiling:
    """The scheduler's side of profiling: it numbers the steps, so it starts and stops every session.

    The loop calls `before_step(next_step_id, has_requests)` before planning a step, `after_plan(step_id)` once its
    plan is sent, `after_result(step_id)` once that step's outputs went to the frontend, and `request`
    for a client's `StartProfile` / `StopProfile` (forwarded by the frontend, answered to it).
    """

    def __init__(self, config: EngineConfig, run_id: str, send_workers: Callable[[Any], None],
                 send_frontend: Callable[[Any], None]) -> None:
        self.profiler = ProcessProfiler("scheduler", config.profile_dir, run_id)
        self.phases = self.profiler.phases
        self.profile_dir = config.profile_dir
        self.window = parse_profile_steps(config.profile_steps) if config.profile_dir else None  # until it starts
        self.default_num_steps = window_length(config)
        self.send_workers, self.send_frontend = send_workers, send_frontend
        self.num_sessions = 0
        self.active: ProfileStart | None = None
        self.stop_after: int | None = None  # the active session's last step, once the workers know it

    def before_step(self, step_id: int, has_requests: bool) -> None:
        """Start the `profile_steps` window when step `step_id`, about to be planned, is its first (and
        there are requests to plan it for: an idle engine's wait for its first request is not traced)."""
        if self.window is None or self.active is not None or step_id < self.window[0] or not has_requests:
            return
        first, end = self.window
        self.window = None  # once: later sessions are the clients'
        if step_id < end:
            why = self._start(step_id, end - 1)
            if why is not None:
                log.error("the --profile-steps window is not traced: %s", why)

    def after_plan(self, step_id: int) -> None:
        if self.active is not None and self.stop_after is None and step_id >= self.active.last_step:
            self._stop_workers(self.active.last_step)

    def after_result(self, step_id: int) -> None:
        if self.stop_after is not None and step_id >= self.stop_after:
            self._finish()

    def request(self, msg: StartProfile | StopProfile, next_step_id: int, steps_in_flight: bool) -> None:
        """Answer a client's request (through the frontend) with a `ProfileStatus`, acting on it first."""
        active = self.active
        if not self.profile_dir:
            self.send_frontend(ProfileStatus(error="profiling is off: start the engine with --profile-dir DIR"))
        elif isinstance(msg, StartProfile):
            if active is not None:
                self.send_frontend(ProfileStatus(
                    active.session, active.first_step, active.last_step, active.folder,
                    error=f"already profiling (session {active.session}, from step {active.first_step}): "
                          "stop it first"))
            elif not 0 <= msg.num_steps <= MAX_PROFILE_STEPS:  # step ids must stay int64 on the wire
                self.send_frontend(ProfileStatus(error=f"num_steps must be in [0, {MAX_PROFILE_STEPS}] (0: "
                                                       f"{self.default_num_steps} steps), got {msg.num_steps}"))
            elif why := self._start(next_step_id, next_step_id + (msg.num_steps or self.default_num_steps) - 1):
                self.send_frontend(ProfileStatus(error=why))
            else:
                started = self.active
                assert started is not None
                self.send_frontend(ProfileStatus(started.session, started.first_step, started.last_step,
                                                 started.folder))
        elif active is None:
            last = (f"; the last session's summary is in "
                    f"{os.path.join(session_folder(self.profile_dir, self.num_sessions), 'summary.txt')}"
                    if self.num_sessions else "")
            sessions = count(self.num_sessions, "session")
            self.send_frontend(ProfileStatus(error=f"not profiling ({sessions} so far{last})"))
        else:
            last = self.stop_after if self.stop_after is not None else min(active.last_step, next_step_id - 1)
            self.send_frontend(ProfileStatus(active.session, active.first_step, last, active.folder))
            if self.stop_after is None:
                self._stop_workers(last)
                if not steps_in_flight:  # every planned step's outputs have gone out
                    self._finish()

    def _start(self, first_step: int, last_step: int) -> str | None:
        """Start a session of steps `first_step..last_step`; returns why it could not start (its folder cannot be
        made: a file in its place, a removed or read-only profile_dir), else None."""
        assert self.profile_dir is not None
        folder = session_folder(self.profile_dir, self.num_sessions + 1)
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            return f"cannot create the session's folder {folder}: {exc.strerror or exc}"
        self.num_sessions += 1
        msg = ProfileStart(self.num_sessions, first_step, last_step, folder)
        self.active, self.stop_after = msg, None
        self.send_workers(msg)
        self.send_frontend(msg)
        self.profiler.start(msg)
        log.info("profiling session %d: steps %d..%d into %s", msg.session, first_step, last_step, msg.folder)
        return None

    def _stop_workers(self, last_step: int) -> None:
        assert self.active is not None
        self.stop_after = last_step
        self.send_workers(ProfileStop(self.active.session, last_step))

    def _finish(self) -> None:
        assert self.active is not None and self.stop_after is not None
        self.profiler.stop(self.stop_after)
        self.send_frontend(ProfileStop(self.active.session, self.stop_after))
        self.active = self.stop_after = None

    def close(self) -> None:
        self.profiler.close()


# ============================================================================ the workers follow
class WorkerProfiling:
    """A worker's side: start at `ProfileStart`; at `ProfileStop`, stop once its last step is finished."""

    def __init__(self, config: EngineConfig, run_id: str, rank: int, device: str) -> None:
        self.profiler = ProcessProfiler(f"worker-tp{rank}", config.profile_dir, run_id, device)
        self.phases = self.profiler.phases
        self.stop_after: int | None = None

    def control(self, msg: ProfileStart | ProfileStop, pending_step_id: int | None) -> None:
        """Apply a session message; `pending_step_id`: the launched step not yet finished, if any."""
        if isinstance(msg, ProfileStart):
            self.stop_after = None
            self.profiler.start(msg)
        elif pending_step_id is None or pending_step_id > msg.last_step:
            self.profiler.stop(msg.last_step)
        else:
            self.stop_after = self.phases.last_step = msg.last_step

    def step_done(self, step_id: int, timings: dict[str, Any]) -> None:
        """A step's tokens are on the host and sent: keep its timings; stop if it was the session's last."""
        if self.profiler.session is None:
            return
        self.profiler.record_step(step_id, timings)
        if self.stop_after is not None and step_id >= self.stop_after:
            self.profiler.stop(self.stop_after)
            self.stop_after = None

    def close(self) -> None:
        self.profiler.close()


# ============================================================================ the frontend follows, merges, answers
class FrontendProfiling:
    """The frontend's side: passes clients' requests to the scheduler and its answers back; traces its own
    loop; when a session stops, merges it in a child process and then answers the clients that stopped it
    with the summary."""

    def __init__(self, config: EngineConfig, run_id: str, reply: Callable[[bytes, Any], None],
                 to_scheduler: Callable[[Any], None]) -> None:
        self.profiler = ProcessProfiler("frontend", config.profile_dir, run_id)
        self.phases = self.profiler.phases
        self.config, self.run_id = config, run_id
        self.reply, self.to_scheduler = reply, to_scheduler
        self.waiting: deque[tuple[bytes, bool]] = deque()  # (client, is_stop): the scheduler answers in this order
        self.stop_waiters: dict[int, list[tuple[bytes, ProfileStatus]]] = {}  # session -> who waits for its summary
        self.merges: dict[int, tuple[subprocess.Popen, str]] = {}  # session -> its running merge and folder
        self.merged: dict[int, ProfileStatus] = {}  # session -> its final status (with summary or error)
        self.folders: dict[int, str] = {}

    def request(self, client: bytes, msg: StartProfile | StopProfile) -> None:
        if not self.profiler.enabled:
            self.reply(client, ProfileStatus(error="profiling is off: start the engine with --profile-dir DIR"))
            return
        self.waiting.append((client, isinstance(msg, StopProfile)))
        self.to_scheduler(msg)

    def from_scheduler(self, msg: ProfileStart | ProfileStop | ProfileStatus) -> None:
        if isinstance(msg, ProfileStart):
            self.folders[msg.session] = msg.folder
            self.profiler.start(msg)
        elif isinstance(msg, ProfileStop):
            self.profiler.stop(msg.last_step)
            self._merge(msg.session)
        elif self.waiting:
            client, is_stop = self.waiting.popleft()
            if msg.error is not None or not is_stop:
                self.reply(client, msg)
            else:
                self.stop_waiters.setdefault(msg.session, []).append((client, msg))
                self._answer_stopped()

    def _merge(self, session: int) -> None:
        folder = self.folders.pop(session)
        cmd = [sys.executable, "-m", "common.timeline", folder, "--run", self.run_id, "--session", str(session),
               "--expect", ",".join(process_names(self.config)), "--wait-s", str(MERGE_WAIT_S)]
        # Its summary goes to stderr, like the engine's logs: stdout may be a one-shot run's --json output.
        self.merges[session] = (subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=sys.stderr), folder)

    def poll(self) -> None:
        """Collect finished merges and answer the clients waiting for them (the loop calls this every second)."""
        for session, (proc, folder) in list(self.merges.items()):
            if proc.poll() is None:
                continue
            del self.merges[session]
            try:
                with open(os.path.join(folder, "summary.txt"), encoding="utf-8") as f:
                    self.merged[session] = ProfileStatus(session, folder=folder, summary=f.read())
            except OSError:
                self.merged[session] = ProfileStatus(session, folder=folder, error=(
                    f"the traces are in {folder}, but merging them failed (exit code {proc.returncode}; "
                    "see the server's log): rerun python -m common.timeline on it"))
        self._answer_stopped()

    def _answer_stopped(self) -> None:
        for session in [s for s in self.stop_waiters if s in self.merged]:
            done = self.merged[session]
            for client, status in self.stop_waiters.pop(session):
                self.reply(client, ProfileStatus(status.session, status.first_step, status.last_step, status.folder,
                                                 done.summary, done.error))

    def close(self, wait_s: float = 120.0) -> None:
        """At exit: write the open session (cut short) and let running merges finish (the launcher merges
        what is left once every process has exited)."""
        self.profiler.close()
        deadline = time.monotonic() + wait_s
        for proc, _ in self.merges.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
