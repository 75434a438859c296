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
import math
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
from common.curve import ENV_VAR as CURVE_ENV_VAR
from common.curve import CurveKeys, CurveServer, client_keys, launch_keys
from common.proc import signal_name
from common.protocol import ProcessFailed, ProcessReady, ProtocolError, decode

log = logging.getLogger("deltaserve.launcher")
PROFILE_SHUTDOWN_S = 120.0  # with profiling, the processes write their traces (and merge) as they stop
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Seconds an idle HTTP keep-alive connection stays open: longer than the idle expiry of common clients' and
# proxies' pools (httpx 5 s, aiohttp 15 s, load balancers <= 60 s; see frontend/openai/server.py).
TIMEOUT_KEEP_ALIVE_S = 65
# Seconds a connection may take to send a request head (from its accept, or from the first byte of a keep-alive
# connection's next request) and between two reads of a body; then it is closed (frontend/openai/connection.py).
TIMEOUT_HEADER_S = 10.0
MAX_TIMEOUT_HEADER_S = 3600.0


def timeout_header_error(seconds: float) -> str | None:
    """Why `seconds` cannot be the header timeout, as the end of a sentence naming it (None: it can)."""
    if math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_HEADER_S:
        return None
    return f"must be a number of seconds in (0, {MAX_TIMEOUT_HEADER_S:g}], got {seconds:g}"


@dataclass(frozen=True)
class HTTPOptions:
    """The OpenAI-compatible HTTP server: `count` processes serving `host`:`port` through `listener` (a
    socket already listening there, `ipc.hold_port`), requiring `api_key` on /v1 routes when set; tool calls
    read by `tool_call_parser` when tool_choice is "auto", which `enable_auto_tool_choice` allows."""

    host: str
    port: int
    listener: socket.socket
    api_key: str | None = None
    count: int = 1
    timeout_keep_alive_s: int = TIMEOUT_KEEP_ALIVE_S
    timeout_header_s: float = TIMEOUT_HEADER_S
    tool_call_parser: str | None = None  # how tool_choice "auto" reads calls (frontend/tool_parsers/)
    enable_auto_tool_choice: bool = False  # tool_choice "auto" is allowed (needs tool_call_parser)


def raise_open_file_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (children inherit it) and return the soft
    limit now in force (-1: unlimited). Every TCP connection of the HTTP server and every ZeroMQ peer is a
    file descriptor: with the common soft default of 1024, a few hundred streaming clients plus their idle
    keep-alive connections exhaust it, and a socket refused by EMFILE is dropped without an error."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # e.g. macOS refuses RLIM_INFINITY: keep the soft limit
            pass
    return -1 if soft == resource.RLIM_INFINITY else int(soft)


class EngineStartError(RuntimeError):
    """A process failed while the engine was starting; the message says which and why."""


class EngineDeadError(RuntimeError):
    """An engine process died while serving; the engine has been shut down."""


class EngineProcesses:
    def __init__(self, config: EngineConfig, client_address: str | None = None, transport: str = "ipc",
                 host: str = "127.0.0.1", local_ranks: list[int] | None = None,
                 on_external_worker: Any = None, client_listener: socket.socket | None = None,
                 client_curve: CurveServer | None = None, http: HTTPOptions | None = None) -> None:
        """`config` is resolved here (raises `ConfigError` for an unusable model or setting, and
        `ValueError` naming a bad DELTASERVE_* environment variable, before any process starts).

        `client_listener`: a socket already listening on `client_address` (`ipc.hold_port`); the frontend
        inherits it and serves on it, so the port stays this engine's while the model loads. Owned (and
        closed) from here on. `client_curve`: serve `client_address` with CURVE (`--client-key`).

        `http`: also serve the OpenAI API over HTTP (its listening socket is owned from here on too).

        `local_ranks`: the worker ranks started here (default: all; rank 0, which serves the
        torch.distributed rendezvous on `host`, must be one). Every other rank is an external worker,
        started by hand (e.g. on a second host) with the command `worker_command(rank)`:
        `on_external_worker(rank, argv, env)` is called with it and the environment variables it needs
        (its CURVE keys). External workers need `transport="tcp"` and a `host` the other host can reach.

        The internal tcp sockets admit only this launch's processes (`common.curve`).
        """
        self.config = config.resolve()
        envs.check_all()
        tp = self.config.tensor_parallel_size
        self.local_ranks = sorted(set(range(tp) if local_ranks is None else local_ranks))
        if not set(self.local_ranks) <= set(range(tp)):
            raise ValueError(f"local_ranks {self.local_ranks} must be in 0..{tp - 1}")
        if len(self.local_ranks) < tp and transport != "tcp":
            raise ValueError("workers started elsewhere need transport='tcp'")
        if 0 not in self.local_ranks:
            raise ValueError("worker rank 0 must be started here: it serves the torch.distributed rendezvous on host")
        self.on_external_worker = on_external_worker
        self.endpoints = ipc.Endpoints.create(self.config.tensor_parallel_size, transport, host)
        self.client_listener = client_listener
        self.http = http
        if http is not None and not 1 <= http.count <= 64:
            raise ValueError(f"api_server_count must be in 1..64, got {http.count}")
        if client_address:
            fd = client_listener.fileno() if client_listener is not None else -1
            self.endpoints = self.endpoints.with_client(client_address, fd)
        if http is not None and client_curve is not None:
            raise ValueError("--client-key secures the ZeroMQ client port, which the HTTP server (--http-port) "
                             "connects to itself: use one or the other (the HTTP server takes --api-key)")
        num_http = http.count if http is not None else 0
        names = ["launcher", "frontend", "scheduler", *(f"worker-tp{r}" for r in range(tp)),
                 *(f"http-{i}" for i in range(num_http))]
        self.keys = launch_keys(self.endpoints, names, client_curve, served_client=bool(client_address),
                                http_servers=num_http)
        self.endpoints = self.endpoints.with_curve(self.keys["launcher"])
        self.client_curve = client_curve
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

    def worker_command(self, rank: int) -> tuple[list[str], dict[str, str]]:
        """What to run (from a checkout of this repository) to start worker `rank` by hand: the command
        line, and the environment variables to set for it (its CURVE keys: secret, keep them off
        command lines)."""
        return self.command("workers", "--rank", str(rank)), self.process_env(f"worker-tp{rank}")

    def process_env(self, name: str) -> dict[str, str]:
        """The environment variables process `name` needs beyond the launcher's own: its CURVE keys."""
        return {CURVE_ENV_VAR: self.keys[name].to_json()}

    def client_keys(self, name: str = "launcher") -> CurveKeys | None:
        """The CURVE keys for a client of `endpoints.client` run by process `name` (this one, or an HTTP
        server "http-<i>", which has its keys in its environment); None: a plain socket."""
        if self.client_curve is not None:
            return client_keys(self.client_curve.public)
        return self.keys[name] if self.endpoints.client in self.keys["frontend"].servers else None

    def _spawn(self, name: str, module: str, *extra: str, pass_fds: tuple[int, ...] = (),
               env_extra: dict[str, str] | None = None) -> None:
        env = envs.absolute_paths({**os.environ, **self.process_env(name)})  # they run in REPO_ROOT, not our cwd
        env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update(env_extra or {})  # e.g. the API key: not on a command line, which `ps` shows to everyone
        cmd = self.command(module, "--parent-pid", str(os.getpid()), *extra)
        self.procs[name] = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT,
                                            pass_fds=(*self.endpoints.fds_of(name), *pass_fds))

    def start(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Start every process and wait until all are ready; returns the frontend's engine info.

        Raises `EngineStartError` (after stopping everything) if a process fails or the timeout passes.
        """
        tp = self.config.tensor_parallel_size
        raise_open_file_limit()  # inherited by every process started below
        try:
            self.control = self.endpoints.make_socket(self.ctx, zmq.PULL, self.endpoints.control, bind=True)
            for rank in range(tp):
                if rank in self.local_ranks:
                    self._spawn(f"worker-tp{rank}", "workers", "--rank", str(rank))
                elif self.on_external_worker is not None:
                    self.on_external_worker(rank, *self.worker_command(rank))
            self._spawn("scheduler", "scheduler_proc")
            self._spawn("frontend", "frontend")
            if self.http is not None:
                fd = self.http.listener.fileno()
                key = {"DELTASERVE_API_KEY": self.http.api_key} if self.http.api_key else {}
                for i in range(self.http.count):
                    curve = ("--client-curve",) if self.client_keys(f"http-{i}") is not None else ()
                    tools = (("--tool-call-parser", self.http.tool_call_parser) if self.http.tool_call_parser
                             else ()) + (("--enable-auto-tool-choice",) if self.http.enable_auto_tool_choice else ())
                    self._spawn(f"http-{i}", "frontend.openai", "--index", str(i), "--http-host", self.http.host,
                                "--http-port", str(self.http.port), "--http-fd", str(fd),
                                "--timeout-keep-alive", str(self.http.timeout_keep_alive_s),
                                "--timeout-header", repr(self.http.timeout_header_s), *curve, *tools, pass_fds=(fd,),
                                env_extra=key)
                self._release_http_listener()
            # Each port is held by the process that binds it now: its exit must free it.
            self._release_client_listener()
            self.endpoints.release_ports()
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
        # Survivors may be stuck in a collective with the dead: do not wait long, not even for their profiles.
        self.shutdown(timeout_s=2.0, profile_grace=False)
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
    def shutdown(self, timeout_s: float = 10.0, profile_grace: bool = True) -> None:
        """Stop every process (SIGTERM, then SIGKILL after `timeout_s`) and remove the socket folder.

        When profiling, the processes write the session they are in as they stop: `profile_grace` gives them
        up to `PROFILE_SHUTDOWN_S` for it, and the sessions left unmerged are merged and printed here.

        A repeated Ctrl-C (or SIGTERM) while this runs does not interrupt it: it only hurries it
        (SIGKILL to the processes left), and the socket folder is removed in every case.
        """
        if self.closed:
            return
        self.closed = True
        self._release_client_listener()
        if self.config.profile_dir and profile_grace:
            timeout_s = max(timeout_s, PROFILE_SHUTDOWN_S)
        self.endpoints.release_ports()
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
            if not hurry.is_set():
                self._finish_profiles()
        finally:
            try:
                if self.control is not None:
                    self.control.close()
            finally:
                self.endpoints.cleanup()
                restore()


    def _finish_profiles(self) -> None:
        """Merge the profiling sessions the shutdown cut short, and print their summaries."""
        if not self.config.profile_dir:
            return
        from common.profiling import run_id_of
        from common.timeline import finish_run

        try:
            for table in finish_run(self.config.profile_dir, run_id_of(self.endpoints.run_dir)):
                print(table, end="", file=sys.stderr, flush=True)
        except Exception as exc:  # the engine has stopped either way; say why there is no timeline
            log.error("could not merge the profile in %s: %s: %s", self.config.profile_dir, type(exc).__name__, exc)


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
