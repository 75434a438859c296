"""What every engine process does the same way: its name, logging, dying with its parent,
signals, profiling, and reporting a fatal error before it exits."""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from common import envs, ipc, protocol
from common.config import ConfigError, EngineConfig
from common.curve import CurveKeys
from common.errors import ExplainedError

LOG_FORMAT = "%(asctime)s %(levelname)s [%(processName)s] %(message)s"


def setup_process(name: str, log_level: str = "WARNING", parent_pid: int | None = None) -> logging.Logger:
    """Name the process for `ps` ("deltaserve-<name>"), configure logging, and arrange to exit
    when the parent (the launcher) dies, even by SIGKILL."""
    global _launcher_pid
    try:
        import setproctitle

        setproctitle.setproctitle(f"deltaserve-{name}")
    except ImportError:  # optional: only `ps` output changes
        pass
    import multiprocessing

    multiprocessing.current_process().name = name
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)
    # The launcher owns Ctrl-C: it stops every process in order. A child only obeys SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_system_exit)
    if parent_pid is not None:
        _launcher_pid = parent_pid
        die_with_parent(parent_pid)
    return logging.getLogger(f"deltaserve.{name}")


def _raise_system_exit(signum: int, frame: Any) -> None:
    if _in_finalizer(frame):
        # Python prints an exception raised in a __del__ ("Exception ignored in ...") and drops it: the
        # process would go on as if never told to stop. Deliver the signal again once out of it.
        threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()
        return
    signal.signal(signum, signal.SIG_IGN)  # once: a second SIGTERM must not interrupt the clean-up
    if stop_signals_deferred.depth:  # in the middle of something that must not be cut (a multipart send)
        stop_signals_deferred.signum = signum
        return
    raise SystemExit(128 + signum)


def _in_finalizer(frame: Any) -> bool:
    """Whether `frame` runs inside an object's `__del__` (e.g. one that a garbage collection triggered)."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


class _StopDeferred:
    """`with stop_signals_deferred:` lets the body finish before SIGTERM becomes `SystemExit`, which
    is then raised at the end of the body. For short sections only, such as sending the frames of one
    ZeroMQ message: one cut after its first frame would glue the next message sent (the error outputs
    a process sends its clients as it stops) onto it. Signal handlers run in the main thread only."""

    def __init__(self) -> None:
        self.depth = 0
        self.signum: int | None = None

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        if not self.depth and self.signum is not None:
            signum, self.signum = self.signum, None
            raise SystemExit(128 + signum)


stop_signals_deferred = _StopDeferred()


def signal_name(signum: int) -> str:
    """"SIGKILL" for 9; "signal 64" for a number with no name here."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


_launcher_pid: int | None = None  # this process's launcher, when it has one (`setup_process`)


def launcher_gone() -> bool:
    """Whether this process was started by a launcher that has since died (killed, or crashed)."""
    return _launcher_pid is not None and parent_gone(_launcher_pid)


def parent_gone(parent_pid: int) -> bool:
    """Whether the launcher `parent_pid` has died. A parent killed but not yet reaped is still our
    parent (a zombie), so its /proc state is read too."""
    if os.getppid() != parent_pid:
        return True
    try:
        with open(f"/proc/{parent_pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):  # e.g. out of file descriptors: no evidence that the parent died
        return False


def die_with_parent(parent_pid: int) -> None:
    """Exit if `parent_pid` goes away: PR_SET_PDEATHSIG on Linux, plus a polling thread."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if parent_gone(parent_pid):  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if parent_gone(parent_pid):
                # The clean path first (sockets closed, socket folder removed), as PR_SET_PDEATHSIG does.
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5.0)
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def trim_heap() -> None:
    """Hand the free pages of the C heap back to the OS (glibc `malloc_trim(0)`; nothing without glibc).

    glibc keeps freed memory for reuse, and memory freed under live allocations cannot shrink the heap: after a
    burst of 10,000 requests the frontend kept +14 MiB, and after replies of 1 MB queued to a client that left,
    +21 MiB, the same after every later round (allocator retention, not a leak). Each engine process calls this
    at its once-a-second tick while it has no request: 4 us when there is nothing to give back."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def set_torch_threads(num_threads: int) -> int:
    """Make torch run its intra-op parallel work on `num_threads` threads in this process; returns `num_threads`.

    Sets OMP_NUM_THREADS, which torch (and the OpenMP runtime it loads) reads when first imported, and which the
    process's children inherit; when torch is imported already, also `torch.set_num_threads`. torch's default is
    one thread per core of the host in every process: on a 2-core host under load, a decode step of the demo model
    then took 2-5 s instead of 35 ms (0.2-0.5 tok/s against 28 with OMP_NUM_THREADS=1), every process's threads
    contending for the same two cores. Raises `ValueError` for a count below 1."""
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(num_threads)
    return num_threads


def torch_threads() -> int:
    """torch's intra-op threads in this process: `torch.get_num_threads()` once torch is imported, else the count it
    will take from OMP_NUM_THREADS (`set_torch_threads`; 0 when that is unset too: torch's own default)."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else envs.omp_num_threads() or 0


@contextlib.contextmanager
def maybe_profile(profile_dir: str | None, name: str) -> Iterator[None]:
    """Run the body under cProfile and write `<profile_dir>/<name>.prof` when it ends."""
    if not profile_dir:
        yield
        return
    os.makedirs(profile_dir, exist_ok=True)
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        path = os.path.join(profile_dir, f"{name}.prof")
        try:
            prof.dump_stats(path)
        except OSError as exc:  # the folder was removed meanwhile: the exit goes on, without this file
            logging.getLogger("deltaserve").error("%s: could not write %s: %s", name, path, exc.strerror or exc)


def engine_process_main(kind: str, module: str, description: str, factory: Callable[..., Any],
                        argv: list[str] | None = None, with_rank: bool = False,
                        add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
                        name_of: Callable[[argparse.Namespace], str] | None = None,
                        threads_of: Callable[[EngineConfig, argparse.Namespace], int] | None = None) -> None:
    """The `main` of an engine process (`python -m <module>`: frontend, scheduler_proc, workers or
    frontend.openai).

    Parses `--config` (EngineConfig JSON), `--endpoints` (Endpoints JSON), `--parent-pid`, for workers
    `--rank`, and whatever `add_arguments(parser)` adds; the process is named `name_of(args)` (default:
    `kind`, or `kind-tpN` for a worker). Sets torch's intra-op threads to `threads_of(config, args)` (default 1:
    a process that runs no tensor math, `set_torch_threads`), then builds the process with
    `factory(config, endpoints, args)` and runs its `start()`, `serve()` and `close()` under the optional
    profiler, reporting a failure to the launcher.
    """
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--endpoints", required=True, help="Endpoints as JSON (socket and rendezvous addresses)")
    if with_rank:
        parser.add_argument("--rank", type=int, default=0, help="tensor-parallel rank")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process (the launcher) ends")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    config = EngineConfig.from_json(args.config)
    try:  # the secret keys come through the environment: a command line is visible to every local user
        keys = CurveKeys.from_environment()
    except ValueError as exc:
        parser.error(str(exc))
    endpoints = ipc.Endpoints.from_dict(json.loads(args.endpoints)).with_curve(keys)
    name = name_of(args) if name_of is not None else f"{kind}-tp{args.rank}" if with_rank else kind
    setup_process(name, config.log_level, args.parent_pid)

    def body() -> None:
        envs.check_all()  # also in a worker started by hand, whose environment the launcher never saw
        set_torch_threads(threads_of(config, args) if threads_of is not None else 1)  # before the factory imports it
        proc = factory(config, endpoints, args)
        try:
            with maybe_profile(config.profile_dir, f"{name}-{os.getpid()}"):
                proc.start()
                proc.serve()
        finally:
            proc.close()
            if args.parent_pid is not None and parent_gone(args.parent_pid):
                endpoints.cleanup()  # the launcher died first (e.g. SIGKILL): leave no socket folder behind

    try:
        run_process(name, endpoints, body, launched=args.parent_pid is not None)
    except SystemExit as exc:
        if exc.code != 128 + signal.SIGTERM:  # a failure (its report may still be on its way out): exit as usual
            raise
        exit_without_teardown(exc.code)
    exit_without_teardown(0)


EXIT_LINGER_S = 2.5  # s: the longest LINGER an engine socket has (2 s), and some slack


def exit_without_teardown(code: int) -> None:
    """End a process whose own clean-up has run (sockets closed, traces and logs written) without the
    interpreter's teardown: with torch, transformers and a tokenizer loaded, freeing every module took about
    0.5 s of CPU per process (the worker's and the frontend's), which every engine stop paid. First the
    messages still lingering on closed sockets go out (the frontend's last word to its clients lingers up to
    2 s): the ZeroMQ context is terminated, as an ordinary exit does, but from a thread given at most
    `EXIT_LINGER_S` (a socket a daemon thread never closed would block the termination for ever). Then logging
    and the standard streams are flushed."""
    ctx = zmq.Context.instance()
    terminated = threading.Thread(target=ctx.term, name="zmq-term", daemon=True)
    terminated.start()
    terminated.join(EXIT_LINGER_S)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def run_process(name: str, endpoints: ipc.Endpoints, body: Callable[[], None], launched: bool = False) -> None:
    """Run a process body; on an exception, tell the launcher why before exiting with code 1: the message
    of an `ExplainedError` or `ConfigError`, else the exception's type and message (its traceback is logged).

    `launched`: started by a launcher, which reports the failure itself (`EngineStartError`, `EngineDeadError`,
    launch.py's error line): the message of an explained failure is then logged at DEBUG only, so that the
    user reads it once. A process started by hand (a worker on another host) logs it as an error."""
    try:
        body()
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # any failure: report it, then die (the launcher stops the rest)
        # Ending already: the launcher's SIGTERM to the survivors must not cut this report short, nor land
        # in a destructor during the exit (Python prints that as an ignored SystemExit with a traceback).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        log = logging.getLogger(f"deltaserve.{name}")
        if isinstance(exc, (ExplainedError, ConfigError)):
            text = str(exc)
            log.log(logging.DEBUG if launched else logging.ERROR, "fatal error: %s", text)
        else:
            text = f"{type(exc).__name__}: {exc}"
            log.error("fatal error:\n%s", traceback.format_exc())
        with contextlib.suppress(Exception):
            ctx = zmq.Context.instance()
            sock = endpoints.make_socket(ctx, zmq.PUSH, endpoints.control, bind=False)
            sock.setsockopt(zmq.LINGER, 2000)
            ipc.send(sock, protocol.ProcessFailed(name=name, error=text))
            sock.close()
        sys.exit(1)


class StepLog:
    """One JSON line of timing per step, to `$DELTASERVE_STEP_LOG_DIR/<name>.jsonl` (off when unset)."""

    def __init__(self, name: str) -> None:
        folder = envs.step_log_dir()
        self._file = None
        if folder:
            os.makedirs(folder, exist_ok=True)
            self._file = open(os.path.join(folder, f"{name}.jsonl"), "a", buffering=1)  # noqa: SIM115 (line-buffered)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def write(self, record: dict[str, object]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
