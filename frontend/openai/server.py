"""The HTTP server process (`python -m frontend.openai`, started by the launcher as http-0, http-1, ...).

One uvicorn server (FastAPI app of `app.py`) per process, on a listening socket the launcher opened
before loading the model and handed down (`--http-fd`): several processes (`--api-server-count`) accept
on the same socket, and the kernel spreads connections over them. Each talks to the frontend as one
ZeroMQ client (`AsyncEngineClient`).

Start-up: the server answers at once (503 until the engine serves); once the frontend has answered
`GetEngineInfo` it reports ready to the launcher. Stop: SIGTERM (from the launcher) makes new requests
503, gives running ones a second to receive the engine's shutdown error (or this process's, if the
frontend is gone), lets uvicorn finish open responses for up to 3 s, and exits with 143 like the other
processes. Ctrl-C belongs to the launcher, which stops every process in order.

Keep-alive: an idle connection stays open `--timeout-keep-alive` seconds (65). A client reuses a pooled
connection until its own expiry (httpx, and so the `openai` package: 5 s; aiohttp: 15 s; nginx and AWS
load balancers: 60 s); a server that closes first races the client's next request, which then arrives on a
socket being closed and fails with a connection reset (httpx's empty `ReadError`), never reaching the app.
uvicorn's default of 5 s equals httpx's expiry: 5 of 200 requests sent after 4.8 to 5 s of idleness were lost.

Slow clients (`connection.py`): a connection must deliver a complete request head within `--timeout-header`
seconds (10) of its accept, or, on a keep-alive connection, of the first byte of its next request (the silence
before that byte is the keep-alive timeout's); a request body may pause at most that long between two reads.
A client that never sent a byte is then closed without a word, any other is answered 408 and closed; a body's
request is ended as if its client had left. Without it, uvicorn held such connections for ever: 500 silent
connections, or a few that trickle a header, kept their descriptors until the cap below was reached and every
other client got a 503.

Connections: each is a file descriptor. The soft RLIMIT_NOFILE is raised to the hard limit at start-up, and at
most `limit - FD_RESERVE` connections are served at once: one beyond them is answered 503 and closed as soon as
it is accepted, before it sends anything (and before the limit drops sockets without a word). A connection that
is answered and closed lingers up to a second, reading what its client still sends, so that the answer is not
lost to a reset.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import logging
import signal
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn
import zmq

from common import envs, ipc
from common.config import EngineConfig
from common.proc import engine_process_main, torch_threads
from common.protocol import ProcessReady
from frontend.async_client import AsyncEngineClient
from frontend.launcher import TIMEOUT_HEADER_S, TIMEOUT_KEEP_ALIVE_S, raise_open_file_limit
from frontend.openai.app import build_app, version
from frontend.openai.connection import HTTPConfig
from frontend.openai.serving import ServerState
from frontend.tool_parsers import TOOL_PARSER_NAMES

log = logging.getLogger("deltaserve.http")
GRACEFUL_SHUTDOWN_S = 3.0
FAIL_OPEN_REQUESTS_AFTER_S = 1.0
LISTEN_BACKLOG = 2048  # connections waiting to be accepted (uvicorn's default)
FD_RESERVE = 128  # descriptors kept for this process's own files and ZeroMQ sockets, beyond its connections
FEW_CONNECTIONS = 4096  # below this many possible connections, the start-up log says how to raise it


def stderr_logging() -> dict[str, Any]:
    """uvicorn's logging configuration with its access log on stderr, beside every other status line of the engine
    (uvicorn's own default writes it to stdout)."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return config


class _Server(uvicorn.Server):
    """uvicorn's server without its own SIGINT/SIGTERM handlers: this process takes SIGTERM itself and
    leaves Ctrl-C to the launcher."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HTTPServerProcess:
    def __init__(self, config: EngineConfig, endpoints: ipc.Endpoints, args: argparse.Namespace) -> None:
        self.config = config
        self.endpoints = endpoints
        self.name = f"http-{args.index}"
        self.host, self.port, self.fd = args.http_host, args.http_port, args.http_fd
        self.timeout_keep_alive_s = args.timeout_keep_alive
        self.timeout_header_s = args.timeout_header
        self.max_connections = self._connection_limit()
        self.control = endpoints.make_socket(zmq.Context.instance(), zmq.PUSH, endpoints.control, bind=False)
        # The client port is CURVE-protected when it is an internal tcp socket (`--transport tcp` without
        # a served --port): this process then connects with its keys, like every internal peer.
        self.client_curve = endpoints.curve if args.client_curve else None
        self.tool_call_parser, self.enable_auto_tool_choice = args.tool_call_parser, args.enable_auto_tool_choice
        self.stopped_by: int | None = None

    def _connection_limit(self) -> int | None:
        """The most connections served at once (None: unbounded), from RLIMIT_NOFILE once raised."""
        nofile = raise_open_file_limit()
        if nofile < 0:
            return None
        limit = max(1, nofile - FD_RESERVE)
        if limit < FEW_CONNECTIONS:
            log.warning("%s can hold only %d connections at once (RLIMIT_NOFILE is %d, and its hard limit); "
                        "connections beyond them get a 503: raise it with `ulimit -Hn` (or LimitNOFILE= in systemd, "
                        "--ulimit nofile= in Docker) before launching", self.name, limit, nofile)
        return limit

    def start(self) -> None:
        pass  # the server answers (503) before the engine is ready: everything happens in serve()

    def serve(self) -> None:
        try:
            import uvloop

            loop_factory: Any = uvloop.new_event_loop
        except ImportError:  # optional: the default loop works, a little slower
            loop_factory = None
        if hasattr(asyncio, "Runner"):  # Python 3.11+
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                runner.run(self._serve())
        else:
            asyncio.run(self._serve())
        if self.stopped_by is not None:
            raise SystemExit(128 + self.stopped_by)

    def _listening_socket(self) -> socket.socket:
        sock = socket.socket(fileno=self.fd) if self.fd >= 0 else ipc.hold_port(self.host, self.port)
        sock.listen(LISTEN_BACKLOG)  # the launcher's 128 would drop connections of a burst of clients
        return sock

    async def _serve(self) -> None:
        client = AsyncEngineClient(self.endpoints.client, curve=self.client_curve)
        await client.start()
        state = ServerState(client, api_key=envs.api_key(), max_body_bytes=envs.http_max_body_bytes(),
                            version=version(), tool_call_parser=self.tool_call_parser,
                            enable_auto_tool_choice=self.enable_auto_tool_choice,
                            reasoning_parser=self.config.reasoning_parser)
        level = self.config.log_level.lower()
        server = _Server(HTTPConfig(build_app(state), timeout_header=self.timeout_header_s,
                                    max_connections=self.max_connections, log_level=level, access_log=level == "debug",
                                    log_config=stderr_logging(),
                                    lifespan="off", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                                    timeout_keep_alive=self.timeout_keep_alive_s, server_header=False))
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._on_sigterm, client, server)
        ready = asyncio.create_task(self._report_ready(client))
        try:
            await server.serve(sockets=[self._listening_socket()])
        finally:
            ready.cancel()
            await client.close()

    async def _report_ready(self, client: AsyncEngineClient) -> None:
        info = await client.engine_info()
        ipc.send(self.control, ProcessReady(self.name, {"url": f"http://{self.host}:{self.port}",
                                                         "model": info.model, "torch_threads": torch_threads()}))
        log.info("%s serving %s on http://%s:%d", self.name, info.model, self.host, self.port)

    def _on_sigterm(self, client: AsyncEngineClient, server: uvicorn.Server) -> None:
        if self.stopped_by is not None:
            return
        self.stopped_by = signal.SIGTERM
        reason = self.endpoints.read_stop_reason()
        why = f"the engine is shutting down: {reason}" if reason else "the engine is shutting down"
        if client.down_reason is None:
            client.down_reason = why
        # The frontend fails every open request when it stops; if it is gone already, this process does.
        asyncio.get_running_loop().call_later(FAIL_OPEN_REQUESTS_AFTER_S, client.fail_all, why)
        server.should_exit = True

    def close(self) -> None:
        self.control.close()


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--index", type=int, default=0, help="which of the HTTP server processes this is")
    parser.add_argument("--http-host", default="127.0.0.1", help="the address served (for messages)")
    parser.add_argument("--http-port", type=int, default=8000, help="the port served")
    parser.add_argument("--http-fd", type=int, default=-1,
                        help="a listening socket inherited from the launcher (-1: bind --http-host:--http-port)")
    parser.add_argument("--timeout-keep-alive", type=int, default=TIMEOUT_KEEP_ALIVE_S,
                        help="seconds an idle keep-alive connection stays open")
    parser.add_argument("--timeout-header", type=float, default=TIMEOUT_HEADER_S,
                        help="seconds a connection may take to send a request head, and between two reads of a body")
    parser.add_argument("--tool-call-parser", choices=TOOL_PARSER_NAMES, default=None,
                        help="how tool_choice 'auto' reads tool calls out of an output (vLLM's names)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="allow tool_choice 'auto' (needs --tool-call-parser)")
    parser.add_argument("--client-curve", action="store_true",
                        help="connect to the frontend's client socket with this process's CURVE keys "
                             "(DELTASERVE_CURVE_KEYS): it is an internal tcp socket")


def main(argv: list[str] | None = None) -> None:
    engine_process_main("http", "frontend.openai", "deltaserve OpenAI-compatible HTTP server (started by launch.py)",
                        HTTPServerProcess, argv, add_arguments=_add_arguments, name_of=lambda a: f"http-{a.index}")
