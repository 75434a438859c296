"""benchmarks/serving.py resends a request that a server reset unanswered on a reused keep-alive connection,
once, and counts the retry; a reset on a new connection is a failure."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import httpx

from benchmarks.serving import Request, send

SSE = (b'data: {"choices": [{"index": 0, "text": "hi"}]}\n\ndata: [DONE]\n\n')
RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % len(SSE)) + SSE


async def reset_server(answers_per_connection: int) -> tuple[asyncio.Server, int, list[int]]:
    """A server that answers `answers_per_connection` requests on each connection, then resets it (RST, the
    request unread) when the next one arrives: a keep-alive timeout firing as a pooled connection is reused.
    Returns the server, its port and the count of requests each connection received."""
    seen: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(0)
        conn = len(seen) - 1
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            seen[conn] += 1
            if seen[conn] > answers_per_connection:
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return
            writer.write(RESPONSE)
            await writer.drain()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def run(answers_per_connection: int) -> tuple[list, list[int]]:
    async def main() -> tuple[list, list[int]]:
        server, port, seen = await reset_server(answers_per_connection)
        async with server, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                             limits=httpx.Limits(max_connections=1)) as http:
            req = Request(0, [1, 2], 2, 1, 0.0)
            results = [await send(http, "/v1/completions", {"prompt": [1, 2]}, req, time.time()) for _ in range(2)]
        return results, seen

    return asyncio.run(main())


def test_a_request_reset_unanswered_on_a_reused_connection_is_sent_again_and_counted() -> None:
    (first, second), seen = run(answers_per_connection=1)
    assert (first.ok, first.retries) == (True, 0)
    assert (second.ok, second.retries, second.output_tokens) == (True, 1, 1)
    assert seen == [2, 1]  # the reset request reached the first connection, its retry a new one


def test_a_reset_on_a_new_connection_fails_without_a_retry() -> None:
    (first, second), seen = run(answers_per_connection=0)
    assert (first.ok, first.retries) == (False, 0) and first.error.startswith(("ReadError", "RemoteProtocolError"))
    assert (second.ok, second.retries) == (False, 0)
    assert seen == [1, 1]
