"""An asyncio client of a running engine: one ZeroMQ socket shared by many concurrent requests.

    client = AsyncEngineClient("ipc:///.../client")
    await client.start()
    info = await client.engine_info()
    (stream,) = client.submit([GenerateRequest(client.new_request_id(), prompt="Hi", stream=True)])
    async for out in stream:          # RequestOutput deltas until the finished one
        print(out.text, end="")

It speaks the messages of `common.protocol` with a `zmq.asyncio` DEALER socket, like `EngineClient`
does synchronously. One task reads the socket and files each output under its request's
`RequestStream`, so any number of coroutines (HTTP handlers) wait on their own requests at once.
A stream closed before its request finished aborts the request.

Liveness: the client pings the frontend every `ping_interval_s` (which also tells the frontend this
client still listens); once the engine has answered, a frontend silent for `dead_after_s` seconds
ends every open request with an `ERROR_ENGINE_DOWN` error, as does the frontend when the engine stops. A frontend
that was only silent (a long stall, not a stop) is served again as soon as it is heard from.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from common import ipc
from common.curve import CurveKeys
from common.errors import quote
from common.protocol import (
    ERROR_ENGINE_DOWN,
    ERROR_INVALID_REQUEST,
    NOT_RUN,
    Abort,
    Detokenize,
    DetokenizeResult,
    EngineInfo,
    EngineStats,
    ErrorReply,
    GenerateRequest,
    GetEngineInfo,
    GetEngineStats,
    Ping,
    Pong,
    ProfileStatus,
    ProtocolError,
    RequestOutput,
    RequestOutputs,
    StartProfile,
    StopProfile,
    Submit,
    Tokenize,
    TokenizeResult,
    decode,
    encode,
    wire_error,
)
from frontend.client import StreamedOutput, batches_within, over_limit, too_large

log = logging.getLogger("deltaserve.async_client")


class EngineUnavailable(RuntimeError):
    """The engine is not serving: still starting, shutting down, or its frontend stopped answering."""


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Several streamed deltas of one request, in the order they came, as one delta: per sample, its texts,
    token ids and logprobs joined, its latest finish and stop reasons and cumulative logprob; the
    request's prompt logprobs (they come once); the last delta's finish, error and metrics. Every sample
    with news in any delta has news in the result. A consumer that falls behind the engine sends one chunk
    for all of them."""
    if len(outputs) == 1:
        return outputs[0]
    merged = StreamedOutput(outputs[0].request_id)
    for out in outputs:
        merged.add(out)
    return merged.output()


class RequestStream:
    """The outputs of one submitted request, in order; iterate with `async for` (each item merges the
    deltas that arrived since the last one). `close()` (or leaving an `async with`) before the finished
    output aborts the request in the engine."""

    def __init__(self, client: AsyncEngineClient, request_id: str) -> None:
        self.client = client
        self.request_id = request_id
        self.finished = False
        self._items: deque[RequestOutput] = deque()
        self._ready = asyncio.Event()

    def _put(self, out: RequestOutput) -> None:
        self._items.append(out)
        self._ready.set()

    async def next_output(self) -> RequestOutput:
        """Every output that arrived since the last call, merged (waits for at least one)."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        items = list(self._items)
        self._items.clear()
        out = merge_outputs(items)
        if out.finished:
            self.finished = True
            self.client._streams.pop(self.request_id, None)
        return out

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            yield await self.next_output()

    def close(self) -> None:
        """Stop listening; abort the request if it has not finished."""
        if self.client._streams.pop(self.request_id, None) is not None and not self.finished:
            self.client.abort([self.request_id])
        self.finished = True

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class AsyncEngineClient:
    """A connection to a running engine for one asyncio event loop (the socket belongs to that loop).

    `address`: the frontend's client address (tcp://host:port or ipc://path). Raises `ValueError`
    naming it if ZeroMQ cannot use it.
    """

    def __init__(self, address: str, ping_interval_s: float = 2.0, dead_after_s: float = 20.0,
                 curve: CurveKeys | None = None) -> None:
        self.address = address
        self.ctx = zmq.asyncio.Context()  # its own: zmq.Context.instance() may be a synchronous one
        try:
            self.sock = ipc.make_socket(self.ctx, zmq.DEALER, address, bind=False, curve=curve)
        except zmq.ZMQError as exc:
            raise ValueError(f"cannot connect to the engine address {address!r}: {exc.strerror}") from None
        self.ping_interval_s = ping_interval_s
        self.dead_after_s = dead_after_s
        self.info: EngineInfo | None = None  # set by the first answer to engine_info()
        self.down_reason: str | None = None  # why the engine is not serving any more
        self._down_by_silence = False  # down_reason is the frontend's silence only, lifted when it is heard again
        self._streams: dict[str, RequestStream] = {}
        self._info_waiters: deque[asyncio.Future[EngineInfo]] = deque()
        # The frontend answers profiling requests in the order they came, without an id: one future per
        # request, in order. A future whose caller gave up stays in line, so a late answer still pairs up.
        self._profile_waiters: deque[asyncio.Future[ProfileStatus]] = deque()
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self._reply_ids = itertools.count(1)
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]
        self._last_heard = time.monotonic()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Start reading the socket and pinging (call from the event loop that will use this client)."""
        self._tasks = [asyncio.create_task(self._read_loop(), name="engine-reader"),
                       asyncio.create_task(self._ping_loop(), name="engine-pinger")]

    @property
    def serving(self) -> bool:
        """Whether the engine has answered and is not known to be going down."""
        return self.info is not None and self.down_reason is None

    @property
    def num_open_requests(self) -> int:
        return len(self._streams)

    def new_request_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    # ------------------------------------------------------------------ requests
    def submit(self, requests: list[GenerateRequest], all_or_nothing: bool = False) -> list[RequestStream]:
        """Send `requests` in one message; returns their streams, in order. A request that cannot be
        encoded (text with a lone surrogate, a number past 64 bits) is not sent: its stream ends at once
        with an `ERROR_INVALID_REQUEST` error naming the field (with `all_or_nothing`, none is sent and every
        other stream ends with a `NOT_RUN` error). `all_or_nothing`: if the engine refuses one request, it
        runs none of them (`Submit`). Raises `EngineUnavailable` if the engine is not serving."""
        if not self.serving:
            raise EngineUnavailable(self.down_reason or "the engine is starting")
        streams = []
        for req in requests:
            stream = RequestStream(self, req.request_id)
            self._streams[req.request_id] = stream
            streams.append(stream)
        limit = self.max_message_bytes
        try:
            data = encode(Submit(requests, all_or_nothing=all_or_nothing))
            if limit and len(data) > limit:
                raise ValueError("larger than the engine's max_message_bytes")
        except (OverflowError, UnicodeEncodeError, TypeError, ValueError):
            # One by one: which requests the wire cannot carry, or that alone exceed the limit (the frontend would
            # drop this client's whole connection, every open stream with it, for a message past its limit).
            sendable, unsendable = [], []
            for req, stream in zip(requests, streams):
                why = wire_error(req) or too_large(req, limit)
                if why is None:
                    sendable.append((req, stream))
                else:
                    unsendable.append(req.request_id)
                    stream._put(RequestOutput(req.request_id, finished=True, finish_reason="error",
                                              error=f"this request cannot be sent: {why}",
                                              error_type=ERROR_INVALID_REQUEST))
            kept = [req for req, _ in sendable]
            if all_or_nothing and kept:
                if unsendable:
                    why = f"{NOT_RUN}request {quote(unsendable[0])} of the same all-or-nothing submission was rejected"
                else:
                    data = encode(Submit(kept, all_or_nothing=True))
                    if not limit or len(data) <= limit:
                        self._send_bytes(data)
                        return streams
                    why = (f"{NOT_RUN}the all-or-nothing submission is {len(data)} bytes encoded, more than the "
                           f"engine's max_message_bytes ({limit}); send fewer prompts at once")
                for req, stream in sendable:
                    stream._put(RequestOutput(req.request_id, finished=True, finish_reason="error", error=why,
                                              error_type=ERROR_INVALID_REQUEST))
                return streams
            for batch in batches_within(kept, limit):
                self._send_bytes(encode(Submit(batch)))
            return streams
        self._send_bytes(data)
        return streams

    @property
    def max_message_bytes(self) -> int:
        """The largest message the engine takes from a client (0: no limit), from its `EngineInfo`."""
        return int(self.info.info.get("max_message_bytes") or 0) if self.info is not None else 0

    def abort(self, request_ids: list[str]) -> None:
        if request_ids and not self.sock.closed:
            self._send_bytes(encode(Abort(list(request_ids))))

    def _send_bytes(self, data: bytes) -> None:
        # A DEALER without a high-water mark queues at once: the send is done on return (no await, so a
        # cancelled handler cannot leave a message half sent). It must go through the asyncio socket, which
        # then re-checks for incoming messages: ZeroMQ signals its file descriptor on edges, and a send made
        # behind its back can swallow the edge that announced an output, leaving the reader asleep.
        fut = self.sock.send(data, copy=False)
        if fut.done():
            fut.result()  # raises the send's error, if any

    # ------------------------------------------------------------------ questions
    async def engine_info(self, timeout_s: float | None = None) -> EngineInfo:
        """The engine's model and limits; waits for the engine to start. Raises `TimeoutError`."""
        fut: asyncio.Future[EngineInfo] = asyncio.get_running_loop().create_future()
        self._info_waiters.append(fut)
        self._send_bytes(encode(GetEngineInfo()))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            if fut in self._info_waiters:
                self._info_waiters.remove(fut)

    async def engine_stats(self, timeout_s: float = 10.0) -> EngineStats:
        return await self._ask(lambda rid: GetEngineStats(rid), timeout_s)

    async def tokenize(self, request: GenerateRequest, timeout_s: float = 60.0) -> TokenizeResult:
        """The token ids of `request`'s prompt or messages, as the engine encodes them; a result with `error`
        for one the wire cannot carry (a lone surrogate, say), unsent."""
        why = wire_error(request)
        if why is None and (limit := self.max_message_bytes):
            why = over_limit(len(encode(Tokenize(0, request))), limit)
        if why is not None:
            return TokenizeResult(0, error=f"this request cannot be sent: {why}")
        return await self._ask(lambda rid: Tokenize(rid, request), timeout_s)

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False,
                         timeout_s: float = 60.0) -> DetokenizeResult:
        return await self._ask(lambda rid: Detokenize(rid, token_ids, skip_special_tokens), timeout_s)

    async def start_profile(self, num_steps: int = 0, timeout_s: float = 60.0) -> ProfileStatus:
        """Start tracing every engine process at the next step, for at most `num_steps` steps (0: the
        length of the engine's --profile-steps window) or until `stop_profile()`. Returns the session's
        status; one with `error` set says why the engine refused (profiling off, a session running).
        Raises `EngineUnavailable` if the engine is not serving, `TimeoutError` after `timeout_s`."""
        return await self._profile_request(StartProfile(num_steps), timeout_s)

    async def stop_profile(self, timeout_s: float = 600.0) -> ProfileStatus:
        """Stop the trace after the last step planned so far; returns once every process's trace is
        written and merged, with the folder and the summary (or `error`: no session running). Raises like
        `start_profile`."""
        return await self._profile_request(StopProfile(), timeout_s)

    async def _profile_request(self, msg: StartProfile | StopProfile, timeout_s: float) -> ProfileStatus:
        if not self.serving:
            raise EngineUnavailable(self.down_reason or "the engine is starting")
        fut: asyncio.Future[ProfileStatus] = asyncio.get_running_loop().create_future()
        self._profile_waiters.append(fut)
        self._send_bytes(encode(msg))
        return await asyncio.wait_for(asyncio.shield(fut), timeout_s)

    async def _ask(self, make: Any, timeout_s: float) -> Any:
        """Send the message `make(reply_id)` and wait for the answer carrying that reply id. Raises
        `EngineUnavailable` if the engine is not serving, `TimeoutError` after `timeout_s`."""
        if not self.serving:
            raise EngineUnavailable(self.down_reason or "the engine is starting")
        reply_id = next(self._reply_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._replies[reply_id] = fut
        try:
            self._send_bytes(encode(make(reply_id)))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._replies.pop(reply_id, None)

    # ------------------------------------------------------------------ background tasks
    async def _read_loop(self) -> None:
        while True:
            try:
                raw = await self.sock.recv(copy=True)
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            self._last_heard = time.monotonic()
            if self._down_by_silence:  # the frontend answers again: it had stalled, not stopped
                log.warning("the engine's frontend at %s answers again; serving", self.address)
                self.down_reason, self._down_by_silence = None, False
            try:
                msg = decode(raw)
            except ProtocolError as exc:
                log.error("malformed message from the engine: %s", exc)
                continue
            if isinstance(msg, RequestOutputs):
                streams = self._streams
                for out in msg.outputs:
                    stream = streams.get(out.request_id)
                    if stream is not None:
                        stream._put(out)
                    if out.error_type == ERROR_ENGINE_DOWN and (self.down_reason is None or self._down_by_silence):
                        self.down_reason, self._down_by_silence = out.error, False
            elif isinstance(msg, EngineInfo):
                self.info = msg
                while self._info_waiters:
                    fut = self._info_waiters.popleft()
                    if not fut.done():
                        fut.set_result(msg)
            elif isinstance(msg, (EngineStats, TokenizeResult, DetokenizeResult)):
                fut = self._replies.get(msg.reply_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, ProfileStatus):
                if self._profile_waiters:
                    fut = self._profile_waiters.popleft()
                    if not fut.done():
                        fut.set_result(msg)
            elif isinstance(msg, ErrorReply):
                log.error("the engine refused a message: %s", msg.error)
            elif not isinstance(msg, Pong):
                log.error("unexpected %s from the engine", type(msg).__name__)

    async def _ping_loop(self) -> None:
        nonce = 0
        while True:
            await asyncio.sleep(self.ping_interval_s)
            nonce += 1
            try:
                self._send_bytes(encode(Ping(nonce)))
            except zmq.ZMQError:
                return
            silent = time.monotonic() - self._last_heard
            if self.info is not None and self.down_reason is None and silent > self.dead_after_s:
                self.fail_all(f"the engine's frontend at {self.address} has not answered for {silent:.0f} s")
                self._down_by_silence = True

    def fail_all(self, why: str) -> None:
        """Mark the engine as down and end every open request with `why` (an `ERROR_ENGINE_DOWN` error)."""
        if self.down_reason is None:
            self.down_reason = why
        for rid, stream in list(self._streams.items()):
            stream._put(RequestOutput(rid, finished=True, finish_reason="error", error=why,
                                      error_type=ERROR_ENGINE_DOWN))
        while self._profile_waiters:  # no answer will come
            fut = self._profile_waiters.popleft()
            if not fut.done():
                fut.set_exception(EngineUnavailable(why))
                fut.exception()  # retrieved here: a caller that gave up must not leave it logged as unhandled

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self.sock.close()
        self.ctx.term()
