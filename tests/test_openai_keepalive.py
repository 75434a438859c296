"""Idle HTTP connections and open-file limits: the server must not drop a request it accepted.

A client pool reuses an idle connection until its own expiry (httpx and the `openai` package: 5 s). A server
whose keep-alive timeout is that short closes the connection just as the client's next request arrives on it:
the request is reset unanswered (httpx's `ReadError` with an empty message). So the server keeps idle
connections longer than common pools do, and starts with its soft RLIMIT_NOFILE raised to the hard limit."""

from __future__ import annotations

import http.client
import os
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.openai_server import HTTPServer, http_process_pid, http_server

HTTPX_KEEPALIVE_EXPIRY_S = 5.0  # httpx.Limits' default, the pool of the `openai` package too


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HTTPServer]:
    with http_server(tiny_qwen3, tmp_path_factory.mktemp("http-keepalive"), "--max-model-len", "256",
                     api_key=None) as s:
        yield s
    assert "Traceback" not in s.stderr(), s.stderr()


def connect(server: HTTPServer) -> http.client.HTTPConnection:
    url = urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.auto_open = 0  # a closed connection must fail, not be reopened behind the test's back
    conn.connect()
    return conn


def get_health(conn: http.client.HTTPConnection) -> int:
    conn.request("GET", "/health")
    response = conn.getresponse()
    response.read()
    return response.status


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the peer closes `sock` (EOF or reset) within `within_s` seconds."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_connection_idle_past_the_httpx_pool_expiry_still_serves_its_next_request(server: HTTPServer) -> None:
    conn = connect(server)
    first_socket = conn.sock
    assert get_health(conn) == 200

    time.sleep(HTTPX_KEEPALIVE_EXPIRY_S + 0.5)  # a pool with a 5 s expiry reuses it until just now

    assert get_health(conn) == 200  # uvicorn's default of 5 s closed it: RemoteDisconnected or a reset
    assert conn.sock is first_socket
    conn.close()


@pytest.fixture(scope="module")
def tuned_server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HTTPServer]:
    """`--timeout-keep-alive 1`, launched with a soft RLIMIT_NOFILE of 200 (as under `ulimit -Sn 200`)."""
    with http_server(tiny_qwen3, tmp_path_factory.mktemp("http-tuned"), "--max-model-len", "256",
                     "--timeout-keep-alive", "1", api_key=None, soft_nofile=200) as s:
        yield s
    assert "Traceback" not in s.stderr(), s.stderr()


def test_timeout_keep_alive_sets_how_long_an_idle_connection_stays_open(tuned_server: HTTPServer) -> None:
    conn = connect(tuned_server)
    assert get_health(conn) == 200
    t0 = time.monotonic()
    assert closed_by_server(conn.sock, within_s=10.0)
    assert 0.8 < time.monotonic() - t0 < 5.0
    conn.close()


def http_process_limits(launcher_pid: int) -> tuple[int, int]:
    """(soft, hard) RLIMIT_NOFILE of the launcher's child deltaserve-http-0, from /proc."""
    with open(f"/proc/{http_process_pid(launcher_pid)}/limits") as f:
        row = next(line for line in f if line.startswith("Max open files")).split()
    soft, hard = (resource.RLIM_INFINITY if v == "unlimited" else int(v) for v in row[3:5])
    return soft, hard


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the HTTP process's limits from /proc")
def test_a_low_soft_open_file_limit_is_raised_to_the_hard_limit_so_hundreds_of_clients_are_served(
        tuned_server: HTTPServer) -> None:
    import asyncio

    import httpx

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    clients = 300
    if hard != resource.RLIM_INFINITY and hard < clients + 400:
        pytest.skip(f"the hard RLIMIT_NOFILE ({hard}) leaves no room to raise a low soft limit")
    s = tuned_server
    assert http_process_limits(s.process.pid) == (hard, hard)

    async def one(http: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": [1000 + i, 2000], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        return (await http.post("/v1/completions", json=body)).status_code

    async def burst() -> list[int]:  # more connections at once than the soft limit of 200 allows
        limits = httpx.Limits(max_connections=clients)
        async with httpx.AsyncClient(base_url=s.url, timeout=120, limits=limits) as http:
            return await asyncio.gather(*(one(http, i) for i in range(clients)))

    assert asyncio.run(burst()) == [200] * clients  # with a soft limit of 200, the HTTP process died
