"""Slow and silent HTTP clients cannot hold the server's connections: a request head must arrive within
`--timeout-header` seconds, a body may not pause longer than that, and a connection beyond the cap is answered
503 at once. uvicorn alone held all of them for ever (500 silent connections: none closed in 60 s, the HTTP
process went from 28 to 535 open files), so a few hundred sockets from one host denied every other client."""

from __future__ import annotations

import http.client
import json
import os
import selectors
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from frontend.openai.connection import LINGER_S
from frontend.openai.server import FD_RESERVE
from tests.openai_server import HTTPServer, http_process_pid, http_server

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="counts the HTTP process's files in /proc")

TIMEOUT_HEADER_S = 1.0
LATE_S = 1.5  # how much later than its deadline a loaded test machine may close a connection
SILENT_CONNECTIONS = 200
CAP = 24  # connections served at once by the capped server


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HTTPServer]:
    with http_server(tiny_qwen3, tmp_path_factory.mktemp("http-slow"), "--max-model-len", "256",
                     "--timeout-header", str(TIMEOUT_HEADER_S), api_key=None) as s:
        yield s
    assert "Traceback" not in s.stderr(), s.stderr()


def address(server: HTTPServer) -> tuple[str, int]:
    url = urlsplit(server.url)
    return url.hostname, url.port


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def steady_open_files(pid: int) -> int:
    """The process's open-file count once it has not changed for longer than a closed connection lingers."""
    count, since = open_files(pid), time.monotonic()
    while time.monotonic() - since < LINGER_S + 0.3:
        time.sleep(0.05)
        now = open_files(pid)
        if now != count:
            count, since = now, time.monotonic()
    return count


def until_closed(sock: socket.socket, within_s: float) -> tuple[float, bytes]:
    """(seconds until the server closed `sock`, what it sent before) ; AssertionError if it is open after
    `within_s`."""
    t0, data = time.monotonic(), b""
    sock.settimeout(0.05)
    while time.monotonic() - t0 < within_s:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return time.monotonic() - t0, data
        data += chunk
    raise AssertionError(f"still open after {within_s} s; received {data!r}")


def error_code(answer: bytes) -> str:
    """The `error.code` of an answer's JSON body."""
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"]


def completion_request(body: bytes) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))


COMPLETION = json.dumps({"prompt": [1000, 2000], "max_tokens": 2, "temperature": 0, "ignore_eos": True}).encode()


def test_200_silent_connections_are_closed_without_a_word_within_the_header_timeout_and_their_files_freed(
        server: HTTPServer) -> None:
    pid = http_process_pid(server.process.pid)
    baseline = steady_open_files(pid)

    opened: dict[socket.socket, float] = {}
    for _ in range(SILENT_CONNECTIONS):
        sock = socket.create_connection(address(server))
        opened[sock] = time.monotonic()
    peak = open_files(pid)
    while peak < baseline + SILENT_CONNECTIONS and time.monotonic() - min(opened.values()) < TIMEOUT_HEADER_S:
        peak = max(peak, open_files(pid))
    assert peak >= baseline + SILENT_CONNECTIONS  # the server accepted every one of them

    closed: dict[socket.socket, tuple[float, bytes]] = {}
    with selectors.DefaultSelector() as selector:
        for sock in opened:
            selector.register(sock, selectors.EVENT_READ)
        deadline = time.monotonic() + TIMEOUT_HEADER_S + LATE_S
        while len(closed) < len(opened) and time.monotonic() < deadline:
            for key, _ in selector.select(0.05):
                try:
                    data = key.fileobj.recv(4096)
                except ConnectionResetError:
                    data = b""
                closed[key.fileobj] = (time.monotonic() - opened[key.fileobj], data)
                selector.unregister(key.fileobj)
    assert len(closed) == SILENT_CONNECTIONS  # uvicorn alone: 0 of them, also after 60 s
    assert {data for _, data in closed.values()} == {b""}  # closed without an answer: nothing was asked
    times = sorted(after for after, _ in closed.values())
    assert TIMEOUT_HEADER_S - 0.05 < times[0] and times[-1] < TIMEOUT_HEADER_S + LATE_S, (times[0], times[-1])

    deadline = time.monotonic() + 2.0
    while open_files(pid) != baseline and time.monotonic() < deadline:
        time.sleep(0.02)
    assert open_files(pid) == baseline
    for sock in opened:
        sock.close()


def test_a_header_trickled_a_byte_at_a_time_is_answered_408_and_closed_within_the_header_timeout(
        server: HTTPServer) -> None:
    with socket.create_connection(address(server)) as sock:
        t0 = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n")
        sock.settimeout(0.1)
        answer = b""
        while time.monotonic() - t0 < TIMEOUT_HEADER_S + LATE_S:
            try:
                sock.sendall(b"x")  # one byte of a header line that never ends
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if not chunk:
                break
            answer += chunk
        closed_after = time.monotonic() - t0

    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
    assert b"connection: close\r\n" in answer and error_code(answer) == "request_timeout"
    assert TIMEOUT_HEADER_S - 0.05 < closed_after < TIMEOUT_HEADER_S + LATE_S


def test_a_request_and_its_keep_alive_reuse_after_twice_the_header_timeout_are_served(server: HTTPServer) -> None:
    conn = http.client.HTTPConnection(*address(server), timeout=30)
    conn.auto_open = 0  # a connection closed by the server must fail the test, not be reopened
    conn.connect()
    first_socket = conn.sock
    conn.request("POST", "/v1/completions", body=COMPLETION, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and json.loads(response.read())["usage"]["completion_tokens"] == 2

    time.sleep(2 * TIMEOUT_HEADER_S)  # idle: the keep-alive timeout's time, not the header timeout's

    conn.request("GET", "/health")
    response = conn.getresponse()
    assert response.status == 200
    response.read()
    assert conn.sock is first_socket
    conn.close()


def test_on_a_keep_alive_connection_the_header_clock_starts_at_the_next_requests_first_byte(
        server: HTTPServer) -> None:
    with socket.create_connection(address(server)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
        time.sleep(1.5 * TIMEOUT_HEADER_S)
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")  # and nothing more
        closed_after, answer = until_closed(sock, TIMEOUT_HEADER_S + LATE_S)

    assert answer.startswith(b"HTTP/1.1 408 ") and error_code(answer) == "request_timeout", answer
    assert closed_after > TIMEOUT_HEADER_S - 0.05


def test_a_body_whose_every_pause_is_shorter_than_the_timeout_is_read_whole_and_answered(server: HTTPServer) -> None:
    pieces = [COMPLETION[i:i + 12] for i in range(0, len(COMPLETION), 12)]
    pause_s = 0.4 * TIMEOUT_HEADER_S
    assert len(pieces) * pause_s > 2 * TIMEOUT_HEADER_S  # the whole body takes longer than the timeout
    with socket.create_connection(address(server)) as sock:
        sock.sendall(completion_request(COMPLETION))
        for piece in pieces:
            time.sleep(pause_s)
            sock.sendall(piece)
        sock.settimeout(30)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer


def test_a_body_that_stops_is_answered_408_one_timeout_after_its_last_bytes(server: HTTPServer) -> None:
    with socket.create_connection(address(server)) as sock:
        sock.sendall(completion_request(COMPLETION) + COMPLETION[:10])
        closed_after, answer = until_closed(sock, TIMEOUT_HEADER_S + LATE_S)

    assert answer.startswith(b"HTTP/1.1 408 ") and error_code(answer) == "request_timeout", answer
    assert closed_after > TIMEOUT_HEADER_S - 0.05
    # The request never reached the engine, and the server goes on serving.
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


@pytest.fixture(scope="module")
def capped_server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HTTPServer]:
    """Launched under a hard RLIMIT_NOFILE that leaves room for CAP connections (as under `ulimit -Hn`)."""
    with http_server(tiny_qwen3, tmp_path_factory.mktemp("http-capped"), "--max-model-len", "256",
                     api_key=None, hard_nofile=FD_RESERVE + CAP) as s:
        yield s
    assert "Traceback" not in s.stderr(), s.stderr()


def served_keep_alive(server: HTTPServer) -> socket.socket:
    """A connection that has been answered one GET /health with 200 and stays open (keep-alive)."""
    sock = socket.create_connection(address(server))
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
    sock.settimeout(10)
    answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer
    return sock


def test_connections_beyond_the_cap_are_answered_503_at_once_without_sending_anything(
        capped_server: HTTPServer) -> None:
    held = [served_keep_alive(capped_server) for _ in range(CAP)]  # every place under the cap, taken

    for _ in range(5):
        with socket.create_connection(address(capped_server)) as sock:
            closed_after, answer = until_closed(sock, 5.0)  # uvicorn alone: no answer until a request arrives
            assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), answer
            assert error_code(answer) == "too_many_connections"
            assert closed_after < 0.5
    # A client that sends its request at once (and reads after) gets the 503 too, not a reset.
    response = httpx.get(f"{capped_server.url}/health", timeout=10)
    assert response.status_code == 503 and response.json()["error"]["code"] == "too_many_connections"

    held.pop().close()  # a place frees: the next connection is served
    deadline = time.monotonic() + 3.0
    while (status := httpx.get(f"{capped_server.url}/health", timeout=10).status_code) != 200:
        assert time.monotonic() < deadline, status
        time.sleep(0.05)
    for sock in held:
        sock.close()
