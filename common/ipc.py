"""ZeroMQ plumbing: the engine's socket addresses and typed send/receive wrappers.

Every socket carries messages of `common.protocol` only. A process binds the sockets it
receives on (PULL, ROUTER) and connects the ones it sends on, so start-up order does not
matter: ZeroMQ queues messages until the peer appears.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import tempfile
from dataclasses import asdict, dataclass, replace
from typing import Any

import zmq

from common import protocol

STOP_REASON_FILE = "stop-reason"  # in the run folder: see Endpoints.write_stop_reason


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

    @classmethod
    def create(cls, tp_size: int, transport: str = "ipc", host: str = "127.0.0.1") -> Endpoints:
        """Fresh addresses for one launch; two launches never share a path or port."""
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        dist_init = f"tcp://{host}:{free_port(host)}"
        run_dir = tempfile.mkdtemp(prefix="deltaserve-")
        if transport == "ipc":
            a = lambda name: f"ipc://{run_dir}/{name}"  # noqa: E731
            return cls(a("client"), a("control"), a("frontend_in"), a("scheduler_in"), a("worker_out"),
                       tuple(a(f"plans-{r}") for r in range(tp_size)), dist_init, run_dir)
        t = lambda: f"tcp://{host}:{free_port(host)}"  # noqa: E731
        return cls(t(), t(), t(), t(), t(), tuple(t() for _ in range(tp_size)), dist_init, run_dir)

    def with_client(self, address: str, fd: int = -1) -> Endpoints:
        """These endpoints with clients served on `address` (through the listening socket `fd`, if given)."""
        return replace(self, client=address, client_fd=fd)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

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
    """A TCP port that was free a moment ago (the OS picks it). Raises `ValueError` for a host that
    cannot be bound here."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError as exc:
            raise ValueError(f"cannot open a port on host {host!r}: {exc}") from None
        return s.getsockname()[1]


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


def make_socket(ctx: zmq.Context, kind: int, address: str, bind: bool, fd: int = -1) -> zmq.Socket:
    """A socket with no send/receive limits and no linger at close (exit never blocks). `fd`: a socket
    already listening on `address` to bind through (ZMQ_USE_FD), instead of a fresh one.

    Raises `zmq.ZMQError` (the socket closed) for an address ZeroMQ cannot bind or connect to."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    try:
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
