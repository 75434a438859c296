"""A ZeroMQ client of a running engine: `EngineClient`, and `StreamedOutput`, which puts a streamed
request's deltas back together.

    python -m frontend.client --port 8000 "What is the capital of France?"    # the command line: client_cli.py

The client talks to the frontend's ROUTER socket with a DEALER socket, in `common.protocol`
messages. While it waits it pings the frontend; if nothing answers for `dead_after_s` seconds it
raises `EngineConnectionError` instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import zmq

from common import ipc
from common.config import MAX_PROFILE_STEPS
from common.curve import CurveKeys
from common.gc_pause import collector_paused
from common.protocol import (
    ERROR_INVALID_REQUEST,
    MAX_REQUEST_ID_CHARS,
    MIN_MAX_MESSAGE_BYTES,
    Abort,
    EngineInfo,
    ErrorReply,
    GenerateRequest,
    GetEngineInfo,
    Ping,
    Pong,
    PositionLogprobs,
    ProfileStatus,
    RequestOutput,
    RequestOutputs,
    SampleOutput,
    StartProfile,
    StopProfile,
    Submit,
    decode,
    encode,
    wire_error,
)
from common.sampling_params import SamplingParams


class EngineConnectionError(RuntimeError):
    """The engine did not answer (not running, wrong address, or it died)."""


def output_dict(out: RequestOutput) -> dict[str, Any]:
    """A finished request's output as plain data, as `LLM.generate` returns it: nano-vllm's `text` and
    `token_ids` (of sample 0) with its `finish_reason`, `stop_reason` and `structured_output_incomplete`, `error`,
    `num_prompt_tokens`, `num_cached_tokens`, `metrics`; `outputs`, one dict per sample (index, text, token_ids,
    finish_reason, stop_reason, logprobs, cumulative_logprob, structured_output_incomplete); and `prompt_logprobs`
    (None unless asked for)."""
    prompt = out.prompt_logprobs
    with collector_paused():  # a dict per position and per top logprob (common.gc_pause)
        return {"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason, "structured_output_incomplete": out.structured_output_incomplete,
                "error": out.error, "num_prompt_tokens": out.num_prompt_tokens,
                "num_cached_tokens": out.num_cached_tokens, "metrics": out.metrics,
                "outputs": [sample_dict(s) for s in out.outputs],
                "prompt_logprobs": None if prompt is None else [p and position_dict(p) for p in prompt]}


def sample_dict(s: SampleOutput) -> dict[str, Any]:
    """`dataclasses.asdict(s)`, written out: asdict deep-copies every field of every nested object by
    recursion, 3.4 s for the 256 outputs of throughput.py --filtered (134,000 positions with 5 top logprobs; CI
    machine), the bound of that benchmark's last requests; this takes 0.3 s."""
    return {"index": s.index, "text": s.text, "token_ids": list(s.token_ids), "finish_reason": s.finish_reason,
            "stop_reason": s.stop_reason,
            "logprobs": None if s.logprobs is None else [position_dict(p) for p in s.logprobs],
            "cumulative_logprob": s.cumulative_logprob, "structured_output_incomplete": s.structured_output_incomplete}


def position_dict(p: PositionLogprobs) -> dict[str, Any]:
    """`dataclasses.asdict(p)`, written out (`sample_dict`)."""
    return {"token_id": p.token_id, "logprob": p.logprob, "rank": p.rank, "decoded_token": p.decoded_token,
            "top": [{"token_id": e.token_id, "logprob": e.logprob, "decoded_token": e.decoded_token,
                     "token_bytes": e.token_bytes} for e in p.top],
            "token_bytes": p.token_bytes}


def set_prompt(req: GenerateRequest, prompt: Any, allow_messages: bool = True) -> None:
    """Put `prompt` into `req`: a str as `prompt`; integer token ids (a list, a tuple, a numpy array
    or torch tensor, numpy integers) as `prompt_token_ids`; vLLM's dict prompts {"prompt": str} and
    {"prompt_token_ids": token ids} as those; with `allow_messages`, a list of {"role", "content"}
    dicts as `messages`.

    Raises `TypeError` for anything else, naming the type it got (or the first item that is not a token id),
    bytes included (they are not token ids: decode them first).
    """
    if isinstance(prompt, Mapping):
        keys = sorted(map(str, prompt))
        if keys == ["prompt"]:
            if not isinstance(prompt["prompt"], str):
                raise TypeError(f"a dict prompt's 'prompt' must be a str, got {type(prompt['prompt']).__name__}")
            req.prompt = prompt["prompt"]
            return
        if keys == ["prompt_token_ids"]:
            ids = _token_ids(prompt["prompt_token_ids"])
            if ids is None:
                raise TypeError(f"a dict prompt's 'prompt_token_ids' must be a sequence of integer token ids, got "
                                f"{_not_token_ids(prompt['prompt_token_ids'])}")
            req.prompt_token_ids = ids
            return
        hint = ("; a chat message goes in a list of them (LLM.chat, EngineClient.generate)"
                if "role" in prompt else "")
        raise TypeError(f"a dict prompt is {{'prompt': str}} or {{'prompt_token_ids': token ids}}; got one with keys "
                        f"{keys}{hint}")
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, (bytes, bytearray, memoryview)):
        raise TypeError(f"a prompt must be a str or a sequence of integer token ids, not {type(prompt).__name__}: "
                        f"decode it to str first")
    elif allow_messages and isinstance(prompt, list) and prompt and all(isinstance(m, Mapping) for m in prompt):
        req.messages = [dict(m) for m in prompt]
    elif (ids := _token_ids(prompt)) is not None:
        req.prompt_token_ids = ids
    else:
        kinds = "a str, a sequence of integer token ids or chat messages" if allow_messages else \
            "a str or a sequence of integer token ids"
        raise TypeError(f"a prompt must be {kinds}, got {_not_token_ids(prompt)}")


def _token_ids(value: Any) -> list[int] | None:
    """`value` as a list of token ids if it is a list, tuple, numpy array or torch tensor of integers (not bools);
    else None."""
    if hasattr(value, "tolist") and not isinstance(value, str):  # a numpy array or torch tensor
        value = value.tolist()
    if isinstance(value, list) and all(type(t) is int for t in value):  # the common case, fast
        return value
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray, memoryview)) and all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value):
        return [int(t) for t in value]
    return None


def _not_token_ids(value: Any) -> str:
    """Why `value` is not token ids, for an error: its first item that is not an integer, or its type."""
    kind = type(value).__name__
    if hasattr(value, "tolist") and not isinstance(value, str):
        value = value.tolist()
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray, memoryview)):
        for i, t in enumerate(value):
            if not isinstance(t, numbers.Integral) or isinstance(t, bool):
                return f"a {kind} with {t!r:.40} ({type(t).__name__}) at index {i}"
    return kind


def over_limit(size: int, limit: int) -> str | None:
    """Why a message of `size` bytes cannot go to an engine that takes at most `limit` (0: no limit); None if it
    fits."""
    return f"it is {size} bytes encoded, more than the engine's max_message_bytes ({limit})" if limit and \
        size > limit else None


def too_large(req: GenerateRequest, limit: int) -> str | None:
    """Why `req` alone is too large to send to an engine that takes messages of at most `limit` bytes (0: no
    limit); None if it fits."""
    return over_limit(len(encode(Submit([req]))), limit) if limit else None


def batches_within(requests: list[GenerateRequest], limit: int) -> list[list[GenerateRequest]]:
    """`requests` (each alone within `limit` bytes encoded; 0: no limit) in order, as few consecutive groups as
    fit one `Submit` message each: a message past the engine's limit is dropped unread, with the sender's
    connection."""
    if not limit:
        return [requests] if requests else []
    base = len(encode(Submit([]))) + 8  # + the array header's growth with the count
    batches: list[list[GenerateRequest]] = []
    batch: list[GenerateRequest] = []
    size = base
    for req in requests:
        n = len(encode(Submit([req]))) - base + 8
        if batch and size + n > limit:
            batches.append(batch)
            batch, size = [], base
        batch.append(req)
        size += n
    if batch:
        batches.append(batch)
    return batches


def _unsendable(req: GenerateRequest) -> str | None:
    """Why `req` cannot be sent (a value msgpack cannot carry, a request id too long); None if it can."""
    if isinstance(req.request_id, str) and len(req.request_id) > MAX_REQUEST_ID_CHARS:
        return f"its request_id has {len(req.request_id)} characters, more than the {MAX_REQUEST_ID_CHARS} allowed"
    return wire_error(req)


class EngineClient:
    """A connection to a running engine (`launch.py --serve`; docs/python-api.md).

    Requests: `generate()` sends one and yields its outputs; or `add_request()` sends one and returns its id,
    `recv_outputs()` returns the outputs of every request as they come, and `abort()` stops requests. Neither
    needs `common.protocol`: a request is a prompt (text or token ids) or chat messages, and `SamplingParams`.

    One thread at a time: ZeroMQ sockets are not thread-safe, so a thread that calls it while another thread's
    `generate()` (or `LLM.generate`) is under way gets a `RuntimeError` saying so, before it sends anything; use
    one client per thread. Taking turns across threads, and several `generate()` iterators in one thread, are
    fine."""

    def __init__(self, address: str, liveness: Callable[[], None] | None = None, ping_interval_s: float = 2.0,
                 dead_after_s: float = 20.0, curve: CurveKeys | None = None) -> None:
        """`address`: the frontend's client address (tcp://host:port or ipc://path); raises
        `ValueError` naming it if ZeroMQ cannot use it.
        `liveness`: called while waiting; may raise to abort the wait (the launcher's `check`).
        `curve`: CURVE keys for a server that uses them (`common.curve.client_keys(server_public_key)`,
        or `EngineProcesses.client_keys()`); a server that does not know them never answers."""
        self.address = address
        self.ctx = zmq.Context.instance()
        try:
            self.sock = ipc.make_socket(self.ctx, zmq.DEALER, address, bind=False, curve=curve)
        except zmq.ZMQError as exc:
            raise ValueError(f"cannot connect to the engine address {address!r}: {exc.strerror} "
                             "(expected tcp://host:port or ipc://path)") from None
        # A DEALER with no peer queues nothing and blocks in send (the server refused this client's CURVE
        # handshake, say): give up after dead_after_s, like a wait for an answer.
        self.sock.setsockopt(zmq.SNDTIMEO, max(1, int(dead_after_s * 1000)))
        self.liveness = liveness
        self.ping_interval_s = ping_interval_s
        self.dead_after_s = dead_after_s
        self._pending: deque[RequestOutput] = deque()
        self._streams: dict[str, deque[RequestOutput]] = {}  # request id -> outputs waiting for its generate()
        self._dropped: set[str] = set()  # requests of generate() iterators closed early: their outputs are dropped
        self._info: EngineInfo | None = None
        self._profile_status: ProfileStatus | None = None
        self._max_message_bytes: int | None = None  # the engine's, once asked (0: no limit)
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
        """A request id unique to this client ("<8 hex digits of this client>-<counter>")."""
        return f"{self._prefix}-{next(self._ids)}"

    # ------------------------------------------------------------------ sending
    def add_request(self, prompt: str | Sequence[int] | Mapping[str, Any] | None = None,
                    params: SamplingParams | None = None, *, messages: list[dict[str, Any]] | None = None,
                    stream: bool = False, request_id: str | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> str:
        """Send one request and return its id; its outputs come from `recv_outputs()`.

        `prompt`: text (encoded as `tokenizer(prompt)` would), token ids, or vLLM's dict prompts `{"prompt": ...}`
        and `{"prompt_token_ids": [...]}`; or instead `messages`, a conversation of `{"role", "content"}` dicts that
        the engine renders with the model's chat template (`chat_template_kwargs`, e.g. `{"enable_thinking": False}`
        for Qwen3, `add_generation_prompt` and `continue_final_message` as in vLLM's `LLM.chat`). `params`: its
        `SamplingParams` (default `SamplingParams()`). `stream`: an output for every step with news (the text and
        token ids new since the last one), else one when it finishes. `request_id`: default `new_request_id()`;
        it must differ from this client's requests still running (the engine refuses a duplicate).

        Raises `TypeError` for a prompt or messages of the wrong type, both or neither given, `params` that are
        not `SamplingParams`, a `request_id` that is not a string or a `stream` that is not a bool. A request the
        engine refuses (a prompt too long, a parameter out of range) is not
        raised: it finishes at once with finish reason "error" and `error` saying why.
        """
        req = self._request(prompt, params, messages, stream, request_id)
        if req.messages is not None:
            req.chat_template_kwargs = dict(chat_template_kwargs or {})
            req.add_generation_prompt, req.continue_final_message = add_generation_prompt, continue_final_message
        with self.exclusive():
            self.submit([req])
        return req.request_id

    def _request(self, prompt: Any, params: SamplingParams | None, messages: list[dict[str, Any]] | None,
                 stream: bool, request_id: str | None) -> GenerateRequest:
        """The `GenerateRequest` of `add_request`'s arguments (`messages` may also come as `prompt`)."""
        if (prompt is None) == (messages is None):
            raise TypeError("give a prompt or messages" + (", not both" if prompt is not None else ""))
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string or None, got {type(request_id).__name__}")
        if not isinstance(stream, bool):
            raise TypeError(f"stream must be True or False, got {type(stream).__name__}")
        if messages is not None and not (isinstance(messages, list) and messages
                                         and all(isinstance(m, Mapping) for m in messages)):
            raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
        req = GenerateRequest(request_id or self.new_request_id(), sampling=(params or SamplingParams()).to_dict(),
                              stream=stream)
        set_prompt(req, messages if messages is not None else prompt)
        return req

    def submit(self, requests: list[GenerateRequest]) -> None:
        """Send `requests` (`common.protocol.GenerateRequest`s: the batch form of `add_request`, one message for
        many requests, which `LLM` uses). One that cannot be encoded (a token id or count past 64 bits, text with a
        lone surrogate), has a request id over `MAX_REQUEST_ID_CHARS` characters, or alone is larger than
        the engine's `max_message_bytes`, is not sent: it finishes at once with finish reason "error"
        naming the bad field or the limit, and `recv_outputs` delivers it like the engine's own
        rejections; the others are sent, in several messages if together they exceed that limit (a
        message that large would be refused unread). Raises `EngineConnectionError` if the engine does
        not tell its limit when asked (only for submissions over `MIN_MAX_MESSAGE_BYTES`)."""
        self._check_thread()
        try:
            data = encode(Submit(requests))
            if any(isinstance(r.request_id, str) and len(r.request_id) > MAX_REQUEST_ID_CHARS for r in requests):
                raise ValueError("a request id is too long")
        except (OverflowError, UnicodeEncodeError, TypeError, ValueError):
            requests = [r for r in requests if self._sendable(r, _unsendable(r))]
            data = encode(Submit(requests))
        if not requests:
            return
        if len(data) <= MIN_MAX_MESSAGE_BYTES or not (limit := self.max_message_bytes()) or len(data) <= limit:
            self._send(data)
            return
        for batch in batches_within([r for r in requests if self._sendable(r, too_large(r, limit))], limit):
            self._send(encode(Submit(batch)))

    def _send(self, data: bytes) -> None:
        """Send one encoded message. Raises `EngineConnectionError` if it cannot leave within `dead_after_s`
        (no connection to the engine)."""
        try:
            self.sock.send(data, copy=False)
        except zmq.Again:
            raise EngineConnectionError(
                f"cannot reach the engine at {self.address}: no connection for {self.dead_after_s:.0f} s (is it "
                f"serving there? a server with --client-key refuses a client without its keys)") from None

    def _sendable(self, req: GenerateRequest, why: str | None) -> bool:
        """True if `why` is None; else False, and `req` finishes at once with that reason."""
        if why is not None:
            self._pending.append(RequestOutput(req.request_id, finished=True, finish_reason="error",
                                               error=f"this request cannot be sent: {why}",
                                               error_type=ERROR_INVALID_REQUEST))
        return why is None

    def max_message_bytes(self) -> int:
        """The largest client message the engine takes (asked once; 0: it sets no limit)."""
        if self._max_message_bytes is None:
            self._max_message_bytes = int(self.engine_info().info.get("max_message_bytes") or 0)
        return self._max_message_bytes

    def abort(self, request_ids: str | list[str]) -> None:
        """Stop these requests of this client's (one id or a list); each then finishes with finish reason "abort"
        and the text it has, delivered by `recv_outputs()`. Ids unknown to the engine or finished are ignored.
        Raises `TypeError` for anything but a string or a list of strings."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        if not isinstance(ids, (list, tuple)) or not all(isinstance(i, str) for i in ids):
            raise TypeError(f"request_ids must be a request id or a list of them, got {type(request_ids).__name__}")
        self._check_thread()
        self._send(encode(Abort(list(ids))))

    def _drop(self, request_id: str) -> None:
        """Abort `request_id` and keep every output of it still to come (its final one too) from `recv_outputs`."""
        if not any(o.request_id == request_id and o.finished for o in self._pending):
            self._dropped.add(request_id)
        self._pending = deque(o for o in self._pending if o.request_id != request_id)
        self.abort([request_id])

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
                with contextlib.suppress(zmq.Again):  # not connected: the silence below ends the wait
                    self.sock.send(encode(Ping(int(now))), zmq.NOBLOCK)
                self._last_ping = now
            if self.sock.poll(100):
                msg = decode(self.sock.recv())
                if isinstance(msg, RequestOutputs):
                    dropped = self._dropped
                    for out in msg.outputs:
                        if out.request_id not in dropped:
                            self._pending.append(out)
                        elif out.finished:
                            dropped.discard(out.request_id)
                    return True
                if isinstance(msg, EngineInfo):
                    self._info = msg
                    return True
                if isinstance(msg, ProfileStatus):
                    self._profile_status = msg
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
        """The outputs that came for this client's requests (`add_request`, `submit`), as soon as there is at least
        one: `RequestOutput`s, at most one per request per step, a request's last one with `finished` set. Waits at
        most `timeout_s` seconds (None: as long as the engine lives), then returns [].

        Outputs of requests that a `generate()` iterator owns go to that iterator instead, and those of a
        `generate()` closed early (its request aborted) to nobody. Raises `EngineConnectionError` if the engine
        does not answer for `dead_after_s` seconds, `RuntimeError` if it refused a message of this client's."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            outputs = []
            for out in self._collect(None if deadline is None else max(0.0, deadline - time.monotonic())):
                box = self._streams.get(out.request_id)
                if box is None:
                    outputs.append(out)
                else:  # a generate() iterator's: it finds the output in its box
                    box.append(out)
            if outputs or (deadline is not None and time.monotonic() >= deadline):
                return outputs

    def _collect(self, timeout_s: float | None) -> list[RequestOutput]:
        """Every output received for this client's requests, waiting at most `timeout_s` (None: as long as the
        engine lives) for at least one; [] when none came."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._pending:  # a message may hold only outputs of dropped requests: wait on
            if not self._receive(None if deadline is None else max(0.0, deadline - time.monotonic())):
                return []
            if not self._pending and deadline is not None and time.monotonic() > deadline:
                return []
        outputs = list(self._pending)
        self._pending.clear()
        return outputs

    def engine_info(self, timeout_s: float = 30.0) -> EngineInfo:
        """The engine's model and limits. Raises `EngineConnectionError` if it does not answer."""
        self._check_thread()
        self._info = None
        self._send(encode(GetEngineInfo()))
        deadline = time.monotonic() + timeout_s
        while self._info is None:
            if not self._receive(max(0.0, deadline - time.monotonic())) and time.monotonic() > deadline:
                raise EngineConnectionError(f"no answer from the engine at {self.address} within {timeout_s:.0f} s")
        return self._info

    # ------------------------------------------------------------------ profiling
    def start_profile(self, num_steps: int = 0, timeout_s: float = 60.0) -> ProfileStatus:
        """Start tracing every engine process at the next step, for at most `num_steps` steps (0: as many as
        the engine's --profile-steps window holds) or until `stop_profile()`. Returns the session's status
        (its number, first and last step, folder). Raises `RuntimeError` with the engine's reason if it
        refuses (profiling off, a session already running), `EngineConnectionError` if it does not answer, and
        `ValueError` for `num_steps` outside [0, MAX_PROFILE_STEPS] (2**31 - 1)."""
        if type(num_steps) is not int or not 0 <= num_steps <= MAX_PROFILE_STEPS:
            raise ValueError(f"num_steps must be an int in [0, {MAX_PROFILE_STEPS}] (0: the engine's window length), "
                             f"got {num_steps!r}")
        return self._profile_request(StartProfile(num_steps), timeout_s)

    def stop_profile(self, timeout_s: float = 600.0) -> ProfileStatus:
        """Stop the trace after the last step planned so far, and wait until the engine has written every
        process's trace and merged them: the status then holds the folder and the summary table. Raises
        `RuntimeError` if no session is running, `EngineConnectionError` if the engine does not answer."""
        return self._profile_request(StopProfile(), timeout_s)

    def _profile_request(self, msg: StartProfile | StopProfile, timeout_s: float) -> ProfileStatus:
        with self.exclusive():
            self._profile_status = None
            self._send(encode(msg))
            deadline = time.monotonic() + timeout_s
            while self._profile_status is None:
                if not self._receive(max(0.0, deadline - time.monotonic())) and time.monotonic() > deadline:
                    raise EngineConnectionError(f"no answer to {type(msg).__name__} from the engine at {self.address} "
                                                f"within {timeout_s:.0f} s")
            status = self._profile_status
            self._profile_status = None
        if status.error is not None:
            raise RuntimeError(status.error)
        return status

    # ------------------------------------------------------------------ convenience
    def generate(self, prompt: str | list[int] | list[dict[str, str]], sampling_params: SamplingParams | None = None,
                 stream: bool = True) -> Iterator[RequestOutput]:
        """Submit one request and yield its outputs (deltas when streaming) until it finishes.

        `prompt`: text, token ids, or chat messages (as `add_request` takes them; raises `TypeError` for other
        types, or for `sampling_params` that are not `SamplingParams`). Closing the iterator early aborts the
        request, and none of its outputs reaches `recv_outputs()` later: its `close()`, or a `break` out of a
        `for` loop over the call itself (an iterator kept in a variable is closed only when it is collected).
        While it is open, `recv_outputs()` leaves its outputs to it. Raises `EngineConnectionError` after
        `close()`.
        """
        if self.sock.closed:
            raise EngineConnectionError("this client has been closed")
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
        req = self._request(prompt, sampling_params, None, stream, None)
        rid = req.request_id
        with self.exclusive():
            box = self._streams[rid] = deque()
            self.submit([req])
            finished = False
            others: list[RequestOutput] = []  # outputs of requests no generate() owns, kept for recv_outputs()
            try:
                while not finished:
                    if not box:  # whoever reads first files each output under its request's iterator
                        for out in self._collect(None):
                            self._streams.get(out.request_id, others).append(out)
                        continue
                    out = box.popleft()
                    finished = out.finished
                    yield out
            finally:
                del self._streams[rid]
                self._pending.extendleft(reversed(others))
                if not finished:
                    self._drop(rid)

    def close(self) -> None:
        self.sock.close()


class StreamedOutput:
    """The whole output of one streamed request so far, put together from its deltas: `add` each
    `RequestOutput` of the request in the order they came, and `output()` is what the request's one
    output would have been without streaming (every sample's text, token ids and logprobs so far)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.samples: dict[int, SampleOutput] = {}  # by index
        self.prompt_logprobs: list[Any] | None = None
        self.last: RequestOutput | None = None  # the latest delta: request-level fields and, once finished, metrics

    def add(self, out: RequestOutput) -> None:
        for delta in out.outputs:
            whole = self.samples.setdefault(delta.index, SampleOutput(delta.index))
            whole.text += delta.text
            whole.token_ids = whole.token_ids + list(delta.token_ids)
            if delta.logprobs is not None:
                whole.logprobs = (whole.logprobs or []) + list(delta.logprobs)
            whole.finish_reason = delta.finish_reason or whole.finish_reason
            if delta.stop_reason is not None:
                whole.stop_reason = delta.stop_reason
            if delta.cumulative_logprob is not None:  # a running sum: the latest is the whole
                whole.cumulative_logprob = delta.cumulative_logprob
            whole.structured_output_incomplete |= delta.structured_output_incomplete
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.last = out

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    @property
    def num_tokens(self) -> int:
        """Output tokens of every sample so far."""
        return sum(len(s.token_ids) for s in self.samples.values())

    def output(self) -> RequestOutput:
        samples = [self.samples[i] for i in sorted(self.samples)] or [SampleOutput(0)]
        first, last = samples[0], self.last or RequestOutput(self.request_id)
        return RequestOutput(self.request_id, first.text, first.token_ids, last.finished, first.finish_reason,
                             last.error, last.num_prompt_tokens, last.num_cached_tokens, dict(last.metrics),
                             first.stop_reason, first.logprobs, first.cumulative_logprob, self.prompt_logprobs,
                             first.index, samples[1:], last.error_type, first.structured_output_incomplete)


if __name__ == "__main__":  # `python -m frontend.client` runs the command line
    from frontend.client_cli import main

    sys.exit(main())
