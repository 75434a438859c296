"""CURVE security for the engine's tcp:// sockets: per-launch keys, who may connect where, and the ZAP
authenticator that enforces it.

ZeroMQ's CURVE mechanism (http://curvezmq.org, RFC 26) encrypts a connection and authenticates the
server to the client by the server's public key; the server authenticates the client through ZAP
(RFC 27), a handler thread that sees each connecting peer's public key and answers yes or no. Here:

- The launcher draws fresh key pairs for every launch with `zmq.curve_keypair`: one server pair that
  every bound internal socket serves with, and one client pair per process (launcher, frontend,
  scheduler, each worker rank). A process learns only its own secrets, through the environment
  variable DELTASERVE_CURVE_KEYS (never the command line, which any local user can read in `ps`).
  Workers bind no socket, so they never hold the server's secret key.
- Every bound internal tcp socket admits only the processes that send to or receive from it
  (`common.ipc.Endpoints.allowed_peers`): a peer without one of those keys fails the handshake and never
  exchanges a message, whatever it sends.
- The client port may use CURVE too (`launch.py --client-key`): its own server key pair, and any
  client that knows its public key, or only those listed (`--client-allowed-keys`).
- ipc:// sockets live in the launch's 0700 folder and stay unencrypted; so does everything when the
  keys are None (addresses made by hand, tests).

Raises `ValueError` for keys that cannot be read, naming where they came from.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("deltaserve.curve")
ENV_VAR = "DELTASERVE_CURVE_KEYS"
MAX_REFUSALS_LOGGED = 10  # per process: an attacker must not be able to fill the log


@dataclass(frozen=True)
class CurveServer:
    """How one bound tcp socket serves: its key pair (Z85 text) and the client public keys it admits
    (None: any client that completes the handshake, i.e. that knows `public`)."""

    public: str
    secret: str
    allowed: tuple[str, ...] | None


@dataclass(frozen=True)
class CurveKeys:
    """One process's CURVE keys (Z85 text, 40 characters each).

    - `public`, `secret`: this process's own pair, presented when it connects.
    - `server_public`: the key the tcp sockets it connects to serve with.
    - `servers`: address -> how this process serves the tcp sockets it binds there.
    """

    public: str
    secret: str
    server_public: str
    servers: dict[str, CurveServer] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str, source: str = ENV_VAR) -> CurveKeys:
        """Raises `ValueError` naming `source` for text that is not such keys."""
        try:
            data = json.loads(text)
            servers = {addr: CurveServer(s["public"], s["secret"],
                                         None if s["allowed"] is None else tuple(s["allowed"]))
                       for addr, s in data.pop("servers").items()}
            keys = cls(**data, servers=servers)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"{source} does not hold deltaserve's CURVE keys ({type(exc).__name__}: {exc})") from None
        for key in (keys.public, keys.secret, keys.server_public):
            if not _is_key(key):
                raise ValueError(f"{source} holds a key that is not 40 characters of Z85")
        return keys

    @classmethod
    def from_environment(cls) -> CurveKeys | None:
        """This process's keys, from DELTASERVE_CURVE_KEYS (None when unset: no CURVE)."""
        text = os.environ.get(ENV_VAR)
        return cls.from_json(text) if text else None

    def apply(self, sock: zmq.Socket, address: str, bind: bool) -> None:
        """Make `sock` a CURVE server (bind) or client (connect) for a tcp:// `address`; leave any other
        address alone. A bound address with no entry in `servers` stays plain (the client port without
        `--client-key`). Call before `bind` / `connect`."""
        if not address.startswith("tcp://"):
            return
        if not bind:
            sock.curve_serverkey = self.server_public.encode()
            sock.curve_publickey = self.public.encode()
            sock.curve_secretkey = self.secret.encode()
            return
        server = self.servers.get(address)
        if server is None:
            return
        _authenticator(sock.context).admit(address, server.allowed)
        sock.zap_domain = address.encode()  # the authenticator's allow-list for this socket
        sock.curve_server = True
        sock.curve_secretkey = server.secret.encode()


class LaunchAddresses(Protocol):
    """What `launch_keys` reads of a launch's addresses: `common.ipc.Endpoints` has it. Declared here, so
    that this module needs none of ours (ipc builds its sockets with these keys)."""

    @property
    def client(self) -> str: ...  # the client port's address

    @property
    def dist_init(self) -> str: ...  # torch.distributed's rendezvous: not a ZeroMQ socket, never CURVE

    def bound_by(self, process: str) -> list[str]: ...  # the addresses `process` binds

    def allowed_peers(self, http_servers: int = 0) -> dict[str, tuple[str, ...]]: ...  # address -> who connects


def launch_keys(endpoints: LaunchAddresses, processes: list[str], client_port: CurveServer | None = None,
                served_client: bool = False, http_servers: int = 0) -> dict[str, CurveKeys]:
    """Fresh keys for one launch: process name ("launcher", "frontend", "scheduler", "worker-tp<r>",
    "http-<i>") -> its `CurveKeys`. Each bound internal tcp address admits only its peers
    (`Endpoints.allowed_peers`, with `http_servers` HTTP server processes).
    With `served_client`, `endpoints.client` is the operator's client port: served with `client_port`
    (None: plain), not with the internal keys."""
    server_public, server_secret = new_key_pair()
    pairs = {name: new_key_pair() for name in processes}
    peers = endpoints.allowed_peers(http_servers)
    keys = {}
    for name in processes:
        servers = {}
        for address in endpoints.bound_by(name):
            if not address.startswith("tcp://") or address == endpoints.dist_init:  # the rendezvous is torch's
                continue
            if served_client and address == endpoints.client:
                if client_port is not None:
                    servers[address] = client_port
                continue
            allowed = tuple(pairs[peer][0] for peer in peers.get(address, ()) if peer in pairs)
            servers[address] = CurveServer(server_public, server_secret, allowed)
        keys[name] = CurveKeys(*pairs[name], server_public, servers)
    return keys


def _is_key(key: Any) -> bool:
    if not isinstance(key, str) or len(key) != 40:
        return False
    try:
        zmq.utils.z85.decode(key.encode())
    except (ValueError, KeyError, TypeError):
        return False
    return True


def new_key_pair() -> tuple[str, str]:
    """A fresh (public, secret) pair, Z85 text."""
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def client_keys(server_public: str, own: tuple[str, str] | None = None) -> CurveKeys:
    """Keys for a client of a CURVE server whose public key is `server_public`: `own` (public, secret)
    if the server admits only listed clients, else a fresh pair."""
    public, secret = own or new_key_pair()
    keys = CurveKeys(public, secret, server_public)
    for key in (public, secret, server_public):
        if not _is_key(key):
            raise ValueError("a CURVE key must be 40 characters of Z85 (as zmq.curve_keypair makes them)")
    return keys


def load_key_file(path: str, secret: bool) -> tuple[str, str | None]:
    """(public, secret) from a certificate file written by `zmq.auth.create_certificates` (the secret is
    None in a public `.key` file). Raises `ValueError` naming the file if it cannot be read, or if
    `secret` is asked for and the file has none (a `.key_secret` file is needed)."""
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the CURVE key file {path!r}: {exc}") from None
    if secret and not secret_key:
        raise ValueError(f"the CURVE key file {path!r} has no secret key (give the .key_secret file)")
    return public.decode(), secret_key.decode() if secret_key else None


def load_allowed_keys(folder: str) -> tuple[str, ...]:
    """The public keys of every certificate file (*.key) in `folder`. Raises `ValueError` naming the
    folder if it cannot be read or holds none."""
    if not os.path.isdir(folder):
        raise ValueError(f"the CURVE allowed-keys folder {folder!r} does not exist")
    try:
        keys = tuple(sorted(k.decode() for k in zmq.auth.load_certificates(folder)))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the CURVE keys in {folder!r}: {exc}") from None
    if not keys:
        raise ValueError(f"the CURVE allowed-keys folder {folder!r} holds no public key file (*.key)")
    return keys


class _Authenticator:
    """The ZAP handler of one ZeroMQ context: a pyzmq `ThreadAuthenticator` whose CURVE check looks up
    the connecting key in the allow-list registered for the socket's ZAP domain (its address)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.allowed: dict[str, frozenset[str] | None] = {}
        self.refusals = 0
        self.thread = ThreadAuthenticator(ctx, log=logging.getLogger("deltaserve.curve.zap"))
        self.thread.start()

    def admit(self, domain: str, keys: tuple[str, ...] | None) -> None:
        self.allowed[domain] = None if keys is None else frozenset(keys)
        self.thread.configure_curve_callback(domain, credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """Called by the ZAP thread for each CURVE handshake on `domain`; `key` is the client's public key (Z85)."""
        allowed = self.allowed.get(domain, frozenset())
        if allowed is None or key.decode() in allowed:
            return True
        self.refusals += 1
        if self.refusals <= MAX_REFUSALS_LOGGED:
            log.warning("refused a connection to %s from a peer with an unknown CURVE key%s", domain,
                        " (further refusals are not logged)" if self.refusals == MAX_REFUSALS_LOGGED else "")
        return False


_authenticators: dict[int, _Authenticator] = {}
_authenticators_lock = threading.Lock()


def _authenticator(ctx: zmq.Context) -> _Authenticator:
    """The context's ZAP handler, started on first use (one per context: ZeroMQ has one ZAP endpoint per context)."""
    with _authenticators_lock:
        auth = _authenticators.get(id(ctx))
        if auth is None or auth.thread.context is not ctx:
            auth = _authenticators[id(ctx)] = _Authenticator(ctx)
        return auth
