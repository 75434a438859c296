"""A ZeroMQ client of a running engine: an importable class and a command line.

    python -m frontend.client --port 8000 "What is the capital of France?"

The client talks to the frontend's ROUTER socket with a DEALER socket, in `common.protocol`
messages. While it waits it pings the frontend; if nothing answers for `dead_after_s` seconds it
raises `EngineConnectionError` instead of waiting forever.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import numbers
import socket
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import zmq

from common import ipc
from common.protocol import (
    ERROR_INVALID_REQUEST,
    Abort,
    EngineInfo,
    ErrorReply,
    GenerateRequest,
    GetEngineInfo,
    Ping,
    Pong,
    RequestOutput,
    RequestOutputs,
    Submit,
    decode,
    encode,
    wire_error,
)
from common.sampling_params import SamplingParams


class EngineConnectionError(RuntimeError):
    """The engine did not answer (not running, wrong address, or it died)."""


def set_prompt(req: GenerateRequest, prompt: Any, allow_messages: bool = True) -> None:
    """Put `prompt` into `req`: a str as `prompt`; integer token ids (a list, a tuple, a numpy array
    or torch tensor, numpy integers) as `prompt_token_ids`; with `allow_messages`, a list of
    {"role", "content"} dicts as `messages`.

    Raises `TypeError` for anything else, bytes included (they are not token ids: decode them first).
    """
    if hasattr(prompt, "tolist") and not isinstance(prompt, str):  # a numpy array or torch tensor of token ids
        prompt = prompt.tolist()
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, (bytes, bytearray, memoryview)):
        raise TypeError(f"a prompt must be a str or a sequence of integer token ids, not {type(prompt).__name__}: "
                        f"decode it to str first")
    elif allow_messages and isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        req.messages = prompt
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):  # the common case, fast
        req.prompt_token_ids = prompt
    elif isinstance(prompt, Sequence) and all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                              for t in prompt):
        req.prompt_token_ids = [int(t) for t in prompt]
    else:
        bad = next((t for t in prompt if not isinstance(t, numbers.Integral) or isinstance(t, bool)), prompt) \
            if isinstance(prompt, Sequence) else prompt
        kinds = "a str, a sequence of integer token ids" + (" or chat messages" if allow_messages else "")
        raise TypeError(f"a prompt must be {kinds}; got {bad!r}")


class EngineClient:
    """A connection to a running engine. One thread at a time: ZeroMQ sockets are not thread-safe, so a
    thread that calls it while another thread's `generate()` (or `LLM.generate`) is under way gets a
    `RuntimeError` saying so, before it sends anything; use one client per thread. Taking turns across
    threads, and several `generate()` iterators in one thread, are fine."""

    def __init__(self, address: str, liveness: Callable[[], None] | None = None, ping_interval_s: float = 2.0,
                 dead_after_s: float = 20.0) -> None:
        """`address`: the frontend's client address (tcp://host:port or ipc://path); raises
        `ValueError` naming it if ZeroMQ cannot use it.
        `liveness`: called while waiting; may raise to abort the wait (the launcher's `check`)."""
        self.address = address
        self.ctx = zmq.Context.instance()
        try:
            self.sock = ipc.make_socket(self.ctx, zmq.DEALER, address, bind=False)
        except zmq.ZMQError as exc:
            raise ValueError(f"cannot connect to the engine address {address!r}: {exc.strerror} "
                             "(expected tcp://host:port or ipc://path)") from None
        self.liveness = liveness
        self.ping_interval_s = ping_interval_s
        self.dead_after_s = dead_after_s
        self._pending: deque[RequestOutput] = deque()
        self._streams: dict[str, deque[RequestOutput]] = {}  # request id -> outputs waiting for its generate()
        self._info: EngineInfo | None = None
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._last_ping = 0.0
        self._threads_lock = threading.Lock()
        self._user_threads: dict[int, int] = {}  # thread id -> its sessions under way (`exclusive`)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold this client for the calling thread (sessions nest). Raises `RuntimeError` if another
        thread holds it."""
        me = threading.get_ident()
        with self._threads_lock:
            self._check_thread(me)
            self._user_threads[me] = self._user_threads.get(me, 0) + 1
        try:
            yield
        finally:
            with self._threads_lock:
                self._user_threads[me] -= 1
                if not self._user_threads[me]:
                    del self._user_threads[me]

    def _check_thread(self, me: int | None = None) -> None:
        me = threading.get_ident() if me is None else me
        other = next((t for t in self._user_threads if t != me), None)
        if other is not None:
            raise RuntimeError(f"this EngineClient is in use by another thread (id {other}): ZeroMQ sockets are "
                               "not thread-safe; make one client per thread")

    def new_request_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    # ------------------------------------------------------------------ sending
    def submit(self, requests: list[GenerateRequest]) -> None:
        """Send `requests`. One that cannot be encoded (a token id or count past 64 bits, text with a
        lone surrogate) is not sent: it finishes at once with finish reason "error" naming the bad
        field, and `recv_outputs` delivers it like the engine's own rejections; the others are sent."""
        self._check_thread()
        try:
            data = encode(Submit(requests))
        except (OverflowError, UnicodeEncodeError, TypeError, ValueError):
            sendable = []
            for req in requests:
                why = wire_error(req)
                if why is None:
                    sendable.append(req)
                else:
                    self._pending.append(RequestOutput(req.request_id, finished=True, finish_reason="error",
                                                       error=f"this request cannot be sent: {why}",
                                                       error_type=ERROR_INVALID_REQUEST))
            if not sendable:
                return
            data = encode(Submit(sendable))
        self.sock.send(data, copy=False)

    def abort(self, request_ids: list[str]) -> None:
        self._check_thread()
        ipc.send(self.sock, Abort(list(request_ids)))

    # ------------------------------------------------------------------ receiving
    def _receive(self, timeout_s: float | None) -> bool:
        """Wait for one message and file it; False on timeout. Raises `EngineConnectionError`."""
        self._check_thread()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last_heard = time.monotonic()
        while True:
            if self.liveness is not None:
                self.liveness()
            now = time.monotonic()
            if now - self._last_ping > self.ping_interval_s:  # also tells the frontend this client still listens
                ipc.send(self.sock, Ping(int(now)))
                self._last_ping = now
            if self.sock.poll(100):
                msg = decode(self.sock.recv())
                if isinstance(msg, RequestOutputs):
                    self._pending.extend(msg.outputs)
                    return True
                if isinstance(msg, EngineInfo):
                    self._info = msg
                    return True
                if isinstance(msg, ErrorReply):
                    raise RuntimeError(f"the engine refused a message: {msg.error}")
                if isinstance(msg, Pong):
                    last_heard = time.monotonic()
                continue
            now = time.monotonic()
            if deadline is not None and now > deadline:
                return False
            if now - last_heard > self.dead_after_s:
                raise EngineConnectionError(f"no answer from the engine at {self.address} for "
                                            f"{self.dead_after_s:.0f} s")

    def recv_outputs(self, timeout_s: float | None = None) -> list[RequestOutput]:
        """The next outputs (any of this client's requests); [] after `timeout_s` seconds."""
        if not self._pending and not self._receive(timeout_s):
            return []
        outputs = list(self._pending)
        self._pending.clear()
        return outputs

    def engine_info(self, timeout_s: float = 30.0) -> EngineInfo:
        """The engine's model and limits. Raises `EngineConnectionError` if it does not answer."""
        self._check_thread()
        self._info = None
        ipc.send(self.sock, GetEngineInfo())
        deadline = time.monotonic() + timeout_s
        while self._info is None:
            if not self._receive(max(0.0, deadline - time.monotonic())) and time.monotonic() > deadline:
                raise EngineConnectionError(f"no answer from the engine at {self.address} within {timeout_s:.0f} s")
        return self._info

    # ------------------------------------------------------------------ convenience
    def generate(self, prompt: str | list[int] | list[dict[str, str]], sampling_params: SamplingParams | None = None,
                 stream: bool = True) -> Iterator[RequestOutput]:
        """Submit one request and yield its outputs (deltas when streaming) until it finishes.

        `prompt`: text, token ids, or chat messages (`set_prompt`; raises `TypeError` for other
        types, or for `sampling_params` that are not `SamplingParams`). Closing the iterator early
        aborts the request. Raises `EngineConnectionError` after `close()`.
        """
        if self.sock.closed:
            raise EngineConnectionError("this client has been closed")
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
        params = sampling_params or SamplingParams()
        rid = self.new_request_id()
        req = GenerateRequest(rid, sampling=params.to_dict(), stream=stream)
        set_prompt(req, prompt)
        with self.exclusive():
            box = self._streams[rid] = deque()
            self.submit([req])
            finished = False
            others: list[RequestOutput] = []  # outputs of requests no generate() owns, kept for recv_outputs()
            try:
                while not finished:
                    if not box:  # whoever reads first files each output under its request's iterator
                        for out in self.recv_outputs():
                            self._streams.get(out.request_id, others).append(out)
                        continue
                    out = box.popleft()
                    finished = out.finished
                    yield out
            finally:
                del self._streams[rid]
                self._pending.extendleft(reversed(others))
                if not finished:
                    self.abort([rid])

    def close(self) -> None:
        self.sock.close()


def undecodable_text(text: str) -> str | None:
    """Where `text` has no UTF-8 encoding (a byte the shell passed undecoded, kept by Python as a
    surrogate escape, or any lone surrogate); None if it has one."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate {text[exc.start]!r}"
        return f"{what} at character {exc.start}"
    return None


def unresolvable_host(address: str) -> tuple[str, str] | None:
    """(host, why) when the host of a tcp:// `address` has no network address; None when it has one
    or `address` is not tcp. ZeroMQ would retry such a host in silence until the client times out."""
    if not address.startswith("tcp://"):
        return None
    host = address[len("tcp://"):].rpartition(";")[2].rpartition(":")[0].strip("[]")  # [src;]host:port
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        return host, getattr(exc, "strerror", None) or str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m frontend.client",
                                description="Submit prompts to a running deltaserve engine and print the answers.")
    p.add_argument("prompts", nargs="+", help="prompt texts")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", default=None, help="full ZMQ address (tcp://... or ipc://...), overrides host/port")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message of the chat template")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt when it finishes (a failed one with its error)")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds without any answer before giving up (> 0)")
    args = p.parse_args(argv)
    if not args.timeout > 0:  # also refuses NaN
        p.error(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                                ignore_eos=args.ignore_eos)
    except ValueError as exc:  # the message starts with the field's name: name the option instead
        name, _, why = str(exc).partition(" ")
        p.error(f"--{name.replace('_', '-')} {why}")
    for n, text in enumerate(args.prompts, 1):
        where = undecodable_text(text)
        if where is not None:
            p.error(f"prompt argument {n} is not UTF-8 text: {where} cannot be decoded (give prompts in UTF-8)")
    if args.address is None and not 0 < args.port < 65536:
        p.error(f"--port must be in 1..65535, got {args.port}")
    address = args.address or f"tcp://{args.host}:{args.port}"
    try:
        client = EngineClient(address, dead_after_s=args.timeout)
    except ValueError as exc:
        p.error(str(exc))
    unresolved = unresolvable_host(address)
    if unresolved is not None:
        client.close()
        host, why = unresolved
        print(f"error: cannot resolve the engine host {host!r} ({'--address' if args.address else '--host'}): {why}",
              file=sys.stderr)
        return 1
    try:
        client.engine_info(timeout_s=args.timeout)
    except EngineConnectionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    stream = len(args.prompts) == 1 and not args.json
    reqs: list[GenerateRequest] = []
    for text in args.prompts:
        req = GenerateRequest(client.new_request_id(), sampling=params.to_dict(), stream=stream)
        if args.chat:
            req.messages = [{"role": "user", "content": text}]
        else:
            req.prompt = text
        reqs.append(req)
    order = {r.request_id: i for i, r in enumerate(reqs)}
    results: dict[str, dict[str, Any]] = {}
    client.submit(reqs)
    status = 0
    try:
        while len(results) < len(reqs):
            for out in client.recv_outputs():
                if stream:
                    sys.stdout.write(out.text)
                    sys.stdout.flush()
                if not out.finished:
                    continue
                results[out.request_id] = {"prompt": args.prompts[order[out.request_id]], "text": out.text,
                                           "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                                           "error": out.error, "num_prompt_tokens": out.num_prompt_tokens,
                                           "num_cached_tokens": out.num_cached_tokens, **out.metrics}
                if out.error:
                    if stream:  # end the line of the text streamed so far
                        print()
                    print(f"error: {out.error}", file=sys.stderr)
                    status = 1
                if args.json:  # every prompt, failed ones too: one object per prompt
                    print(json.dumps(results[out.request_id], ensure_ascii=False))
                elif not stream and not out.error:
                    print(f"--- {results[out.request_id]['prompt']}\n{out.text}\n")
        if stream and not status:
            print()
    except KeyboardInterrupt:
        client.abort([r.request_id for r in reqs])
        return 130
    except EngineConnectionError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
