"""Start the engine's processes, wait until they are ready, watch them, stop them.

One engine = one frontend, one scheduler and one worker per tensor-parallel rank, plus, when it
serves HTTP, one or more OpenAI-compatible HTTP server processes (`frontend/openai/`), each a
separate `python -m <package>` process (so each can also be started by hand, e.g. a worker on
another host, or under a profiler). Every process reports ready or failed on the launcher's
control socket. If any process dies, `check()` raises `EngineDeadError` naming it, after
stopping all the others (the frontend first fails its pending requests with that same reason);
children also die with the launcher (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from common import envs, ipc
from common.config import EngineConfig
from common.proc import signal_name
from common.protocol import ProcessFailed, ProcessReady, ProtocolError, decode

log = logging.getLogger("deltaserve.launcher")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class HTTPOptions:
    """The OpenAI-compatible HTTP server: `count` processes serving `host`:`port` through `listener` (a
    socket already listening there, `ipc.hold_port`), requiring `api_key` on /v1 routes when set."""

    host: str
    port: int
    listener: socket.socket
    api_key: str | None = None
    count: int = 1


class EngineStartError(RuntimeError):
    """A process failed while the engine was starting; the message says which and why."""


class EngineDeadError(RuntimeError):
    """An engine process died while serving; the engine has been shut down."""


class EngineProcesses:
    def __init__(self, config: EngineConfig, client_address: str | None = None, transport: str = "ipc",
                 host: str = "127.0.0.1", local_ranks: list[int] | None = None,
                 on_external_worker: Any = None, client_listener: socket.socket | None = None,
                 http: HTTPOptions | None = None) -> None:
        """`config` is resolved here (raises `ConfigError` for an unusable model or setting, and
        `ValueError` naming a bad DELTASERVE_* environment variable, before any process starts).

        `client_listener`: a socket already listening on `client_address` (`ipc.hold_port`); the frontend
        inherits it and serves on it, so the port stays this engine's while the model loads. Owned (and
        closed) from here on.

        `http`: also serve the OpenAI API over HTTP (its listening socket is owned from here on too).

        `local_ranks`: the worker ranks started here (default: all). Every other rank is an external
        worker, started by hand (e.g. on a second host) with the command `worker_command(rank)`;
        `on_external_worker(rank, argv)` is called with it. External workers need `transport="tcp"`
        and a `host` address the other host can reach.
        """
        self.config = config.resolve()
        envs.check_all()
        tp = self.config.tensor_parallel_size
        self.local_ranks = sorted(set(range(tp) if local_ranks is None else local_ranks))
        if not set(self.local_ranks) <= set(range(tp)):
            raise ValueError(f"local_ranks {self.local_ranks} must be in 0..{tp - 1}")
        if len(self.local_ranks) < tp and transport != "tcp":
            raise ValueError("workers started elsewhere need transport='tcp'")
        self.on_external_worker = on_external_worker
        self.endpoints = ipc.Endpoints.create(self.config.tensor_parallel_size, transport, host)
        self.client_listener = client_listener
        self.http = http
        if http is not None and not 1 <= http.count <= 64:
            raise ValueError(f"api_server_count must be in 1..64, got {http.count}")
        if client_address:
            fd = client_listener.fileno() if client_listener is not None else -1
            self.endpoints = self.endpoints.with_client(client_address, fd)
        self.ctx = zmq.Context.instance()
        self.control: zmq.Socket | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.failures: list[str] = []
        self.info: dict[str, Any] = {}
        self.process_info: dict[str, dict[str, Any]] = {}  # process name -> what it reported when ready
        self.closed = False

    # ------------------------------------------------------------------ start
    def command(self, module: str, *extra: str) -> list[str]:
        """The command line of one engine process (config and addresses as JSON arguments)."""
        return [sys.executable, "-m", module, "--config", self.config.to_json(),
                "--endpoints", json.dumps(self.endpoints.to_dict()), *extra]

    def worker_command(self, rank: int) -> list[str]:
        """What to run (from a checkout of this repository) to start worker `rank` by hand."""
        return self.command("workers", "--rank", str(rank))

    def _spawn(self, name: str, module: str, *extra: str, pass_fds: tuple[int, ...] = (),
               env_extra: dict[str, str] | None = None) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update(env_extra or {})  # e.g. the API key: not on a command line, which `ps` shows to everyone
        cmd = self.command(module, "--parent-pid", str(os.getpid()), *extra)
        self.procs[name] = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, pass_fds=pass_fds)

    def start(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Start every process and wait until all are ready; returns the frontend's engine info.

        Raises `EngineStartError` (after stopping everything) if a process fails or the timeout passes.
        """
        self.control = ipc.make_socket(self.ctx, zmq.PULL, self.endpoints.control, bind=True)
        tp = self.config.tensor_parallel_size
        try:
            for rank in range(tp):
                if rank in self.local_ranks:
                    self._spawn(f"worker-tp{rank}", "workers", "--rank", str(rank))
                elif self.on_external_worker is not None:
                    self.on_external_worker(rank, self.worker_command(rank))
            self._spawn("scheduler", "scheduler_proc")
            listener_fds = (self.endpoints.client_fd,) if self.client_listener is not None else ()
            self._spawn("frontend", "frontend", pass_fds=listener_fds)
            self._release_client_listener()  # the frontend holds the port now: its exit must free it
            if self.http is not None:
                fd = self.http.listener.fileno()
                key = {"DELTASERVE_API_KEY": self.http.api_key} if self.http.api_key else {}
                for i in range(self.http.count):
                    self._spawn(f"http-{i}", "frontend.openai", "--index", str(i), "--http-host", self.http.host,
                                "--http-port", str(self.http.port), "--http-fd", str(fd), pass_fds=(fd,),
                                env_extra=key)
                self._release_http_listener()
            waiting = set(self.procs) | {f"worker-tp{r}" for r in range(tp)}
            deadline = time.monotonic() + timeout_s
            while waiting:
                self._read_control(waiting, timeout_ms=200)
                self._raise_if_dead(EngineStartError)
                if time.monotonic() > deadline:
                    raise EngineStartError(f"the engine did not start within {timeout_s:.0f} s "
                                           f"(still waiting for {sorted(waiting)})")
        except BaseException:
            self.shutdown()
            raise
        return self.info

    def _read_control(self, waiting: set[str] | None = None, timeout_ms: int = 0) -> None:
        assert self.control is not None
        if not self.control.poll(timeout_ms):
            return
        for raw in ipc.recv_all(self.control):
            try:
                msg = decode(raw)
            except ProtocolError as exc:
                log.error("malformed control message: %s", exc)
                continue
            if isinstance(msg, ProcessReady):
                self.process_info[msg.name] = dict(msg.info)
                if waiting is not None:
                    waiting.discard(msg.name)
                if msg.name == "frontend":
                    self.info = dict(msg.info)
            elif isinstance(msg, ProcessFailed):
                self.failures.append(f"{msg.name}: {msg.error}")

    def _release_client_listener(self) -> None:
        if self.client_listener is not None:
            self.client_listener.close()
            self.client_listener = None

    def _release_http_listener(self) -> None:
        if self.http is not None and self.http.listener.fileno() >= 0:
            self.http.listener.close()

    # ------------------------------------------------------------------ watch
    def _raise_if_dead(self, error: type[RuntimeError]) -> None:
        dead = {name: p.returncode for name, p in self.procs.items() if p.poll() is not None}
        if not dead and not self.failures:
            return
        time.sleep(0.1)  # let a dying process's failure report arrive
        self._read_control()
        exits = {name: f"{name} exited with code {code} ({_how_it_ended(self.procs[name].pid, code)})"
                 for name, code in dead.items()}
        # Causes before consequences: a stopped process reports nothing itself (its peers only see it fall
        # silent), and one killed by a signal reported nothing either (its peers lost it in a collective).
        stopped = [f"{name} (pid {p.pid}) is stopped (SIGSTOP, or a debugger)" for name, p in self.procs.items()
                   if _is_stopped(p.pid)]
        killed = [exits.pop(name) for name, code in dead.items() if code < 0]
        message = "; ".join(stopped + killed + self.failures + list(exits.values())) or "an engine process failed"
        try:  # the frontend tells its clients this, rather than that it got SIGTERM
            self.endpoints.write_stop_reason(message)
        except OSError as exc:
            log.warning("could not leave the frontend the reason of the shutdown: %s", exc)
        self.shutdown(timeout_s=2.0)  # survivors may be stuck in a collective with the dead: do not wait long
        raise error(f"{message}; the engine was shut down")

    def check(self) -> None:
        """Raise `EngineDeadError` if any engine process has died (stopping the rest first)."""
        if self.closed:
            raise EngineDeadError("the engine has been shut down")
        self._read_control()
        self._raise_if_dead(EngineDeadError)

    def wait(self) -> None:
        """Block until a process dies (raises `EngineDeadError`) or the caller is interrupted."""
        while True:
            self._read_control(timeout_ms=500)
            self._raise_if_dead(EngineDeadError)

    # ------------------------------------------------------------------ stop
    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every process (SIGTERM, then SIGKILL after `timeout_s`) and remove the socket folder.

        A repeated Ctrl-C (or SIGTERM) while this runs does not interrupt it: it only hurries it
        (SIGKILL to the processes left), and the socket folder is removed in every case.
        """
        if self.closed:
            return
        self.closed = True
        self._release_client_listener()
        self._release_http_listener()
        hurry = threading.Event()
        restore = _divert_stop_signals(hurry.set)
        try:
            for p in self.procs.values():
                if p.poll() is None:
                    p.terminate()
                    p.send_signal(signal.SIGCONT)  # a stopped process only acts on SIGTERM once resumed
            deadline = time.monotonic() + timeout_s
            while (any(p.poll() is None for p in self.procs.values()) and time.monotonic() < deadline
                   and not hurry.is_set()):
                time.sleep(0.02)
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
        finally:
            try:
                if self.control is not None:
                    self.control.close()
            finally:
                self.endpoints.cleanup()
                restore()


def _how_it_ended(pid: int, code: int) -> str:
    """"pid 12, killed by SIGKILL" for a process that exited with code -9, "pid 12" for code 1."""
    return f"pid {pid}" if code >= 0 else f"pid {pid}, killed by {signal_name(-code)}"


def _is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (state T in /proc/<pid>/stat; False where that cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _divert_stop_signals(handler: Callable[[], None]) -> Callable[[], None]:
    """Make SIGINT and SIGTERM call `handler()` instead of their handlers (which may raise in the
    middle of a clean-up); returns the function that puts the old handlers back. Signal handlers
    belong to the main thread: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.signal(sig, lambda signum, frame: handler()) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore
