"""ZeroMQ plumbing: the engine's socket addresses and typed send/receive wrappers.

Every socket carries messages of `common.protocol` only. A process binds the sockets it
receives on (PULL, ROUTER) and connects the ones it sends on, so start-up order does not
matter: ZeroMQ queues messages until the peer appears.

Ports: every tcp port of a launch is taken when its addresses are made (`Endpoints.create`) and
held by the launcher until the process that binds it inherits the listening socket (ZMQ_USE_FD,
or the rendezvous store's `master_listen_fd`): a port probed and let go could be taken by anyone
in between, even as the local port of an outgoing connection.

Security: tcp sockets use CURVE with the launch's keys (`common.curve`), so that only the engine's
own processes can connect to them; ipc sockets live in the launch's 0700 folder.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass, field, fields, replace
from typing import Any

import zmq

from common import protocol
from common.curve import CurveKeys

STOP_REASON_FILE = "stop-reason"  # in the run folder: see Endpoints.write_stop_reason

# The longest path a Unix-domain socket address may have (sockaddr_un.sun_path less its NUL): 107 bytes on Linux.
IPC_PATH_MAX_LEN = getattr(zmq, "IPC_PATH_MAX_LEN", 0) or 107


def run_folder(longest_name: str) -> str:
    """A new per-launch folder (mode 0700) for ipc sockets named up to `longest_name`: under the temporary folder
    ($TMPDIR), or under /tmp when a socket path there would be longer than a socket address allows (a deep
    $TMPDIR). Raises `OSError` if neither can hold it."""
    run_dir = tempfile.mkdtemp(prefix="deltaserve-")
    if len(os.fsencode(os.path.join(run_dir, longest_name))) <= IPC_PATH_MAX_LEN:
        return run_dir
    os.rmdir(run_dir)
    run_dir = tempfile.mkdtemp(prefix="deltaserve-", dir="/tmp")
    if len(os.fsencode(os.path.join(run_dir, longest_name))) > IPC_PATH_MAX_LEN:
        os.rmdir(run_dir)
        raise OSError(f"no folder for the engine's ipc sockets: {run_dir} is too deep for a socket address")
    return run_dir


@dataclass(frozen=True)
class Endpoints:
    """The addresses of one engine launch (ipc:// paths in a per-launch folder, or tcp://).

    - `client`: frontend ROUTER, clients connect DEALER sockets here.
    - `control`: launcher PULL, every process reports ready / failed here.
    - `frontend_in`: frontend PULL, the scheduler's outputs.
    - `scheduler_in`: scheduler PULL, the frontend's requests.
    - `worker_out`: scheduler PULL, the workers' hand-shakes and step results.
    - `plans`: one scheduler PUSH per worker rank, step plans.
    - `dist_init`: torch.distributed rendezvous (tcp://host:port), for tensor parallelism.
    - `run_dir`: the per-launch folder: the ipc sockets, and the launcher's stop reason
      (`write_stop_reason`); "" where there is none (addresses made by hand).
    - `client_fd`: a socket already listening on `client` that the frontend inherits from the
      launcher (`hold_port`) and serves on, or -1: the frontend binds `client` itself.
    - `listen_fds`: tcp address -> a socket listening there, held since `create`, that the process
      binding the address inherits (the launcher passes each process its own: `bound_by`).
    - `curve`: this process's CURVE keys for its tcp sockets (None: plain sockets). Secret: never
      serialised, each process reads its own from the environment (`CurveKeys.from_environment`).

    Who binds what: the launcher `control`; the frontend `client` and `frontend_in`; the scheduler
    `scheduler_in`, `worker_out` and `plans`; worker rank 0 the rendezvous `dist_init`.
    """

    client: str
    control: str
    frontend_in: str
    scheduler_in: str
    worker_out: str
    plans: tuple[str, ...]
    dist_init: str
    run_dir: str = ""
    client_fd: int = -1
    listen_fds: dict[str, int] = field(default_factory=dict)
    curve: CurveKeys | None = field(default=None, repr=False, compare=False)
    # The launcher's listening sockets behind `listen_fds` (closed by `release_ports`); not serialised.
    held: tuple[socket.socket, ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def create(cls, tp_size: int, transport: str = "ipc", host: str = "127.0.0.1") -> Endpoints:
        """Fresh addresses for one launch; two launches never share a path or port. Every tcp port is
        held from here on (`listen_fds`; `release_ports` closes this process's copies). The rendezvous
        `dist_init` listens on `host` only, and exists only for `tp_size` > 1 ("" otherwise).

        Raises `ValueError` for a transport other than ipc or tcp, or a host that cannot be bound here."""
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        held: dict[str, socket.socket] = {}

        def t() -> str:
            s = listen_on(host)
            address = f"tcp://{_url_host(host)}:{s.getsockname()[1]}"
            held[address] = s
            return address

        try:
            dist_init = t() if tp_size > 1 else ""
            if transport == "tcp":
                addresses = [t() for _ in range(5)]  # client, control, frontend_in, scheduler_in, worker_out
                plans = tuple(t() for _ in range(tp_size))
        except BaseException:
            for s in held.values():
                s.close()
            raise
        names = ["client", "control", "frontend_in", "scheduler_in", "worker_out"]
        plan_names = [f"plans-{r}" for r in range(tp_size)]
        run_dir = run_folder(max(names + plan_names, key=len))
        if transport == "ipc":
            addresses = [f"ipc://{run_dir}/{name}" for name in names]
            plans = tuple(f"ipc://{run_dir}/{name}" for name in plan_names)
        return cls(*addresses, plans, dist_init, run_dir, listen_fds={a: s.fileno() for a, s in held.items()},
                   held=tuple(held.values()))

    def with_client(self, address: str, fd: int = -1) -> Endpoints:
        """These endpoints with clients served on `address` (through the listening socket `fd`, if given)."""
        return replace(self, client=address, client_fd=fd)

    def with_curve(self, keys: CurveKeys | None) -> Endpoints:
        return replace(self, curve=keys)

    def bound_by(self, process: str) -> list[str]:
        """The addresses process `process` ("launcher", "frontend", "scheduler", "worker-tp<r>") binds."""
        return {"launcher": [self.control], "frontend": [self.client, self.frontend_in],
                "scheduler": [self.scheduler_in, self.worker_out, *self.plans],
                "worker-tp0": [self.dist_init] if self.dist_init else []}.get(process, [])

    def allowed_peers(self, http_servers: int = 0) -> dict[str, tuple[str, ...]]:
        """Bound address -> the processes that connect to it: the only peers its CURVE server admits.
        `client` lists the launcher (its own client, `LLM` or a one-shot run) and the `http_servers` HTTP
        server processes ("http-<i>"); a served client port is the operator's (`--client-key`)."""
        workers = tuple(f"worker-tp{r}" for r in range(len(self.plans)))
        http = tuple(f"http-{i}" for i in range(http_servers))
        peers = {self.control: ("frontend", "scheduler", *workers, *http), self.client: ("launcher", *http),
                 self.frontend_in: ("scheduler",), self.scheduler_in: ("frontend",), self.worker_out: workers}
        peers.update({address: (worker,) for address, worker in zip(self.plans, workers)})
        return peers

    def fds_of(self, process: str) -> tuple[int, ...]:
        """The held listening sockets process `process` inherits (its bound tcp addresses)."""
        fds = [self.listen_fds[a] for a in self.bound_by(process) if a in self.listen_fds]
        if process == "frontend" and self.client_fd >= 0:
            fds.append(self.client_fd)
        return tuple(fds)

    def release_ports(self) -> None:
        """Close this process's copies of the held listening sockets (once every process that binds
        them has been started with its own copy, or at shutdown)."""
        for s in self.held:
            s.close()

    def make_socket(self, ctx: zmq.Context, kind: int, address: str, bind: bool,
                    max_message_bytes: int = 0) -> zmq.Socket:
        """`make_socket` for one of these addresses: through its inherited listening socket, if any, and
        with this process's CURVE keys on tcp."""
        fd = -1
        if bind:
            fd = self.client_fd if address == self.client and self.client_fd >= 0 else self.listen_fds.get(address, -1)
            if fd >= 0 and any(s.fileno() == fd for s in self.held):
                fd = os.dup(fd)  # bound here, in the holder (the launcher): ZeroMQ owns its copy, release_ports ours
        return make_socket(ctx, kind, address, bind, fd, curve=self.curve, max_message_bytes=max_message_bytes)

    def to_dict(self) -> dict[str, Any]:
        skip = ("curve", "held")
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        return {**d, "plans": list(self.plans), "listen_fds": dict(self.listen_fds)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Endpoints:
        return cls(**{**d, "plans": tuple(d["plans"])})

    def write_stop_reason(self, reason: str) -> None:
        """Leave `reason` (why the launcher stops the engine, e.g. which process died and how) in the run
        folder, for the frontend to tell its clients when the launcher's SIGTERM comes: otherwise it could
        only say that it got SIGTERM. Written whole or not at all; raises `OSError`."""
        if not self.run_dir:
            return
        path = os.path.join(self.run_dir, STOP_REASON_FILE)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(reason)
        os.replace(path + ".tmp", path)

    def read_stop_reason(self) -> str | None:
        """What `write_stop_reason` left (at most 4096 characters), or None: none left, or it cannot be read."""
        if not self.run_dir:
            return None
        try:
            with open(os.path.join(self.run_dir, STOP_REASON_FILE), encoding="utf-8") as f:
                return f.read(4096) or None
        except (OSError, ValueError):  # ValueError: not UTF-8
            return None

    def cleanup(self) -> None:
        """Remove the per-launch folder (and the socket files in it)."""
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it), for tests and tools: anyone may take it
    before it is bound (the engine's own ports are held: `listen_on`). Raises `ValueError` for a host
    that cannot be bound here."""
    with listen_on(host) as s:
        return s.getsockname()[1]


def listen_on(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on `host`:`port` (0: a port the OS picks), IPv4 or IPv6 as `host` is.
    Raises `ValueError` naming the host for one that cannot be bound here."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"cannot open a port on host {host!r}: {exc}") from None
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((host, port))
        s.listen(128)
    except OSError as exc:
        s.close()
        raise ValueError(f"cannot open a port on host {host!r}: {exc.strerror or exc}") from None
    return s


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def hold_port(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host`:`port`, for the frontend to serve clients on (`Endpoints.client_fd`).

    Taken before the engine loads its model and kept until the frontend serves, so that a busy port is
    reported at once, and no other server (a second engine started meanwhile) can take it in between:
    that one is refused here instead. Ports in TIME_WAIT pass, as ZeroMQ reuses them too. Raises
    `AddressInUseError` naming the port if another socket listens there, `ValueError` if it cannot be listened
    on for another reason (a host that is not an address of this machine, say)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
        s.listen(128)
    except OSError as exc:
        s.close()
        error = AddressInUseError if exc.errno == errno.EADDRINUSE else ValueError
        raise error(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
    return s


class AddressInUseError(ValueError):
    """`hold_port`: another socket listens on that address already."""


def make_socket(ctx: zmq.Context, kind: int, address: str, bind: bool, fd: int = -1, curve: CurveKeys | None = None,
                max_message_bytes: int = 0) -> zmq.Socket:
    """A socket with no send/receive queue limits and no linger at close (exit never blocks). `fd`: a
    socket already listening on `address` to bind through (ZMQ_USE_FD), instead of a fresh one.
    `curve`: CURVE keys for a tcp address (`CurveKeys.apply`). `max_message_bytes` > 0: a peer that
    sends a larger message is disconnected before the message is read (ZMQ_MAXMSGSIZE).

    Raises `zmq.ZMQError` (the socket closed) for an address ZeroMQ cannot bind or connect to."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    try:
        if max_message_bytes > 0:
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if curve is not None:
            curve.apply(sock, address, bind)
        if fd >= 0:
            sock.setsockopt(zmq.USE_FD, fd)
        if bind:
            if address.startswith("ipc://"):  # a stale socket file of an earlier bind, if any, gives way
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(address[len("ipc://"):])
            sock.bind(address)
        else:
            sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return sock


def send(sock: zmq.Socket, msg: Any) -> None:
    sock.send(protocol.encode(msg), copy=False)


def recv(sock: zmq.Socket, timeout_ms: int | None = None) -> Any:
    """The next message, or None after `timeout_ms`. Raises `ProtocolError` on a malformed one."""
    if timeout_ms is not None and not sock.poll(timeout_ms):
        return None
    return protocol.decode(sock.recv(copy=True))


def recv_all(sock: zmq.Socket) -> list[bytes]:
    """Every message waiting on the socket now (raw bytes), without blocking."""
    frames = []
    while True:
        try:
            frames.append(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return frames
