"""One HTTP connection of the server: uvicorn's httptools protocol, with a read deadline and a connection cap.

uvicorn times only an idle keep-alive connection, from the end of a response: a connection that never sends,
or sends a request head a byte at a time, or stops in the middle of a body, is held for ever (a file descriptor
and, for a body, a task). `HTTPConnection` closes each of them after `timeout_header` seconds:
- the request head: from the accept for a connection's first request (nginx's client_header_timeout starts
  there too), and on a keep-alive connection from the first byte of the next request (the silence before it is
  the keep-alive timeout's). A connection that never sent a byte is closed without a word; one that started a
  request is answered 408.
- the request body: between two reads (nginx's client_body_timeout), so a large upload at any steady rate passes.
  A request whose body stops is answered 408 (the app sees the client leave), or closed if its response started.
The clock runs only while the server reads: not while it holds a pipelined request back or waits for the app
to take a buffered body.

A connection beyond `max_connections` is answered 503 as soon as it is accepted, before it sends anything
(uvicorn's own `limit_concurrency` answers only once a request head arrives, so a silent connection over the
cap was held anyway).
"""

from __future__ import annotations

import asyncio
import json
from asyncio import TimerHandle
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from frontend.launcher import timeout_header_error
from frontend.openai.errors import APIError

# After answering a connection the server closes, it waits this long for the client to close first, reading and
# dropping what the client still sends: closing a socket with unread input sends a reset, which can destroy the
# answer before the client reads it (Windows clients drop what they received; a lost segment is never resent).
LINGER_S = 1.0
# At most this many connections of a process linger at once: each holds a descriptor beyond the cap, out of
# server.py's FD_RESERVE (a flood of 160 silent connections over the cap filled it). The rest close at once.
MAX_LINGERING = 32


class HTTPConfig(uvicorn.Config):
    """uvicorn's settings served by `HTTPConnection`: `timeout_header` (seconds, `timeout_header_error` says
    which) for a request head and between body reads, and `max_connections` open at once (None: unbounded).
    Raises ValueError for a timeout out of range."""

    def __init__(self, app: Any, *, timeout_header: float, max_connections: int | None, **kwargs: Any) -> None:
        error = timeout_header_error(timeout_header)
        if error is not None:
            raise ValueError(f"timeout_header {error}")
        super().__init__(app, http=HTTPConnection, ws="none", **kwargs)
        self.timeout_header = timeout_header
        self.max_connections = max_connections


class HTTPConnection(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol with the read deadline and the connection cap of the module docstring."""

    lingering: ClassVar[int] = 0  # connections of this process answered and lingering (file descriptors)

    def __init__(self, config: HTTPConfig, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.timeout_header = config.timeout_header
        self.max_connections = config.max_connections
        self.read_deadline: TimerHandle | None = None  # armed while the server waits for a client's bytes
        self.spoke = False  # the client sent at least one byte
        self.reading_body = False  # between a request's head and the end of its body
        self.answered = False  # answered by this class (408, 503): what still arrives is dropped
        self.linger: TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        over_cap = self.max_connections is not None and len(self.connections) >= self.max_connections
        super().connection_made(transport)
        if over_cap:
            self.connections.discard(self)  # not served: it must not hold a place under the cap
            self.answer_and_close(503, "too many connections to this server: try again in a moment",
                                  "server_error", "too_many_connections")
            return
        self.arm_read_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_read_deadline()
        if self.linger is not None:
            self.linger.cancel()
            self.linger = None
            HTTPConnection.lingering -= 1
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.answered:
            return
        self.spoke = True
        # Between requests (uvicorn has just cancelled its keep-alive timer): these bytes start a request head.
        if self.read_deadline is None and (self.cycle is None or self.cycle.response_complete):
            self.arm_read_deadline()
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self.reading_body = True
        self.arm_read_deadline()  # now for the body; on_message_complete cancels it when there is none
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self.arm_read_deadline()
        super().on_body(body)

    def on_message_complete(self) -> None:
        self.reading_body = False
        self.cancel_read_deadline()
        super().on_message_complete()

    def arm_read_deadline(self) -> None:
        self.cancel_read_deadline()
        self.read_deadline = self.loop.call_later(self.timeout_header, self.read_timed_out)

    def cancel_read_deadline(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def read_timed_out(self) -> None:
        self.read_deadline = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # the server holds the bytes back, not the client
            self.arm_read_deadline()
            return
        if self.reading_body:
            cycle = self.cycle
            if not cycle.response_complete:
                cycle.disconnected = True  # the app's receive() says the client left; its response goes nowhere
                cycle.message_event.set()
            if cycle.response_started:  # answered already, or answering: no room for a 408
                self.transport.close()
                return
        elif not self.spoke:
            self.transport.close()
            return
        self.answer_and_close(408, f"the request did not arrive within {self.timeout_header:g} s (--timeout-header)",
                              "invalid_request_error", "request_timeout")

    def answer_and_close(self, status: int, message: str, type: str, code: str) -> None:
        """Send `status` with OpenAI's error JSON and close the connection (lingering, see LINGER_S)."""
        self.answered = True
        self.cancel_read_deadline()
        self._unset_keepalive_if_required()
        body = json.dumps(APIError(status, message, type, code=code).body()).encode()
        head = [STATUS_LINE[status]]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)]
        self.transport.write(b"".join(head) + body)
        if HTTPConnection.lingering >= MAX_LINGERING or not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()  # the client reads the answer, then its close ends this one (eof_received)
        self.linger = self.loop.call_later(LINGER_S, self.transport.close)
        HTTPConnection.lingering += 1
