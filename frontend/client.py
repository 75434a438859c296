"""A ZeroMQ client of a running engine: an importable class and a command line.

    python -m frontend.client --port 8000 "What is the capital of France?"
    python -m frontend.client --port 8000 --start-profile     # then --stop-profile (engine run with --profile-dir)

The client talks to the frontend's ROUTER socket with a DEALER socket, in `common.protocol`
messages. While it waits it pings the frontend; if nothing answers for `dead_after_s` seconds it
raises `EngineConnectionError` instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import numbers
import os
import socket
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import zmq

from common import ipc
from common.curve import CurveKeys, client_keys, load_key_file
from common.errors import quote
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
from frontend.cli import ArgumentParser, HelpFormatter


class EngineConnectionError(RuntimeError):
    """The engine did not answer (not running, wrong address, or it died)."""


def output_dict(out: RequestOutput) -> dict[str, Any]:
    """A finished request's output as plain data, as `LLM.generate` returns it: nano-vllm's `text` and
    `token_ids` (of sample 0) with its `finish_reason` and `stop_reason`, `error`, `num_prompt_tokens`,
    `num_cached_tokens`, `metrics`; `outputs`, one dict per sample (index, text, token_ids, finish_reason,
    stop_reason, logprobs, cumulative_logprob); and `prompt_logprobs` (None unless asked for)."""
    prompt = out.prompt_logprobs
    return {"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason, "error": out.error, "num_prompt_tokens": out.num_prompt_tokens,
            "num_cached_tokens": out.num_cached_tokens, "metrics": out.metrics,
            "outputs": [dataclasses.asdict(s) for s in out.outputs],
            "prompt_logprobs": None if prompt is None else [p and dataclasses.asdict(p) for p in prompt]}


# Sampling flags shared by the client and launch.py (vLLM's names); their values build SamplingParams.
SAMPLING_FLAGS = ("n", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                  "min_tokens", "stop", "logprobs", "prompt_logprobs")


def add_sampling_arguments(group: Any) -> None:
    """Add the sampling flags beyond --temperature, --max-tokens, --ignore-eos and --seed to a parser group."""
    group.add_argument("--n", type=int, default=1, help="samples per prompt (the prompt is computed once)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep tokens while the "
                       "probability of those more likely is below this, in (0, 1]; 1 = off")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 or -1 = off")
    group.add_argument("--min-p", type=float, default=0.0,
                       help="drop tokens less likely than this times the most likely one, in [0, 1]; 0 = off")
    group.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="> 0: logits of prompt and output tokens are divided (positive) or multiplied "
                            "(negative) by it; 1 = off")
    group.add_argument("--presence-penalty", type=float, default=0.0,
                       help="in [-2, 2]: subtracted from the logit of every token already generated")
    group.add_argument("--frequency-penalty", type=float, default=0.0,
                       help="in [-2, 2]: times its count, subtracted from the logit of every generated token")
    group.add_argument("--min-tokens", type=int, default=0, help="tokens to generate before a stop token or "
                       "stop string may end the output")
    group.add_argument("--stop", action="append", default=None, help="a stop string (repeat for several)")
    group.add_argument("--logprobs", type=int, default=None,
                       help="return each sampled token's logprob and the N most likely (0..20)")
    group.add_argument("--prompt-logprobs", type=int, default=None,
                       help="return each prompt token's logprob and the N most likely (0..20)")
    # Structured outputs (SamplingParams.structured_outputs): at most one of these.
    group.add_argument("--json-schema", default=None, metavar="SCHEMA",
                       help="constrain the output to JSON valid against this schema (JSON text, or @FILE)")
    group.add_argument("--json-object", action="store_true", help="constrain the output to some JSON object")
    group.add_argument("--regex", default=None, help="constrain the whole output to match this regular expression")
    group.add_argument("--choice", action="append", default=None,
                       help="constrain the output to exactly one of these strings (repeat for each)")
    group.add_argument("--grammar", default=None, metavar="EBNF",
                       help="constrain the output to this EBNF (GBNF) grammar with a root rule (text, or @FILE)")


# Structured-output flag -> the StructuredOutputsParams field it sets
STRUCTURED_FLAGS = {"json_schema": "json", "json_object": "json_object", "regex": "regex", "choice": "choice",
                    "grammar": "grammar"}


def _structured_outputs_from_args(parser: ArgumentParser, args: Any) -> tuple[str, dict[str, Any]] | None:
    """(the flag, the structured_outputs dict) of the structured-output flags, None without any; exits naming
    the flag for two of them or for an @FILE that cannot be read."""
    given = {flag: getattr(args, flag) for flag in STRUCTURED_FLAGS if getattr(args, flag) not in (None, False)}
    if not given:
        return None
    options = [f"--{flag.replace('_', '-')}" for flag in given]
    if len(given) > 1:
        parser.error(f"{options[1]}: only one structured-output flag may be set, got {' and '.join(options)}")
    (flag, value), = given.items()
    if flag in ("json_schema", "grammar") and value.startswith("@"):
        try:
            with open(value[1:], encoding="utf-8") as f:
                value = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            parser.error(f"{options[0]}: cannot read {quote(value[1:])}: {exc}")
    return options[0], {STRUCTURED_FLAGS[flag]: value}


def sampling_params_from_args(parser: ArgumentParser, args: Any, **fields: Any) -> SamplingParams:
    """SamplingParams from the sampling flags (`args`, parsed by `parser`) plus `fields`; a bad value exits
    with a one-line error naming its flag (e.g. "--top-p must be a finite number in (0, 1] ...")."""
    option, structured = _structured_outputs_from_args(parser, args) or (None, None)
    try:
        return SamplingParams(**fields, **{name: getattr(args, name) for name in SAMPLING_FLAGS},
                              structured_outputs=structured)
    except ValueError as exc:
        message = str(exc)
        if option is not None and message.startswith("structured_outputs"):
            parser.error(f"{option}: {message}")
        parser.option_error(message)


def set_prompt(req: GenerateRequest, prompt: Any, allow_messages: bool = True) -> None:
    """Put `prompt` into `req`: a str as `prompt`; integer token ids (a list, a tuple, a numpy array
    or torch tensor, numpy integers) as `prompt_token_ids`; vLLM's dict prompts {"prompt": str} and
    {"prompt_token_ids": token ids} as those; with `allow_messages`, a list of {"role", "content"}
    dicts as `messages`.

    Raises `TypeError` for anything else, bytes included (they are not token ids: decode them first).
    """
    if isinstance(prompt, Mapping):
        keys = sorted(map(str, prompt))
        if keys == ["prompt"] and isinstance(prompt["prompt"], str):
            req.prompt = prompt["prompt"]
            return
        if keys == ["prompt_token_ids"] and not isinstance(prompt["prompt_token_ids"], str):
            set_prompt(req, prompt["prompt_token_ids"], allow_messages=False)
            return
        hint = ("; a chat message goes in a list of them (LLM.chat, EngineClient.generate)"
                if "role" in prompt else "")
        raise TypeError(f"a dict prompt is {{'prompt': str}} or {{'prompt_token_ids': token ids}}; got one with keys "
                        f"{keys}{hint}")
    if hasattr(prompt, "tolist") and not isinstance(prompt, str):  # a numpy array or torch tensor of token ids
        prompt = prompt.tolist()
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, (bytes, bytearray, memoryview)):
        raise TypeError(f"a prompt must be a str or a sequence of integer token ids, not {type(prompt).__name__}: "
                        f"decode it to str first")
    elif allow_messages and isinstance(prompt, list) and prompt and all(isinstance(m, Mapping) for m in prompt):
        req.messages = [dict(m) for m in prompt]
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


def _unsendable(req: GenerateRequest) -> str | None:
    """Why `req` cannot be sent (a value msgpack cannot carry, a request id too long); None if it can."""
    if isinstance(req.request_id, str) and len(req.request_id) > MAX_REQUEST_ID_CHARS:
        return f"its request_id has {len(req.request_id)} characters, more than the {MAX_REQUEST_ID_CHARS} allowed"
    return wire_error(req)


class EngineClient:
    """A connection to a running engine. One thread at a time: ZeroMQ sockets are not thread-safe, so a
    thread that calls it while another thread's `generate()` (or `LLM.generate`) is under way gets a
    `RuntimeError` saying so, before it sends anything; use one client per thread. Taking turns across
    threads, and several `generate()` iterators in one thread, are fine."""

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
        return f"{self._prefix}-{next(self._ids)}"

    # ------------------------------------------------------------------ sending
    def submit(self, requests: list[GenerateRequest]) -> None:
        """Send `requests`. One that cannot be encoded (a token id or count past 64 bits, text with a
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
        base = len(encode(Submit([]))) + 8  # + the array header's growth with the count
        batch: list[GenerateRequest] = []
        size = base
        for req in requests:
            n = len(encode(Submit([req]))) - base + 8
            too_large = f"it is {n + base} bytes encoded, more than the engine's max_message_bytes ({limit})"
            if not self._sendable(req, too_large if n + base > limit else None):
                continue
            if batch and size + n > limit:
                self._send(encode(Submit(batch)))
                batch, size = [], base
            batch.append(req)
            size += n
        if batch:
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

    def abort(self, request_ids: list[str]) -> None:
        self._check_thread()
        self._send(encode(Abort(list(request_ids))))

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
                    self._pending.extend(msg.outputs)
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
        refuses (profiling off, a session already running), `EngineConnectionError` if it does not answer."""
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
                             first.index, samples[1:], last.error_type)


# The metrics every `--json` line carries, null where a request has none (one refused before it ran).
JSON_METRICS = ("ttft_s", "e2e_s", "num_preemptions", "queue_s")


def json_row(prompt: str, out: RequestOutput) -> dict[str, Any]:
    """One line of `--json` output (client and launch.py): the prompt, `output_dict` with the metrics
    flattened in; every key of `JSON_METRICS` is present, None where `out` lacks it, so that a failed
    prompt's line has the same keys as a finished one's."""
    row = {"prompt": prompt, **output_dict(out)}
    metrics = row.pop("metrics")
    row.update({key: None for key in JSON_METRICS}, **metrics)
    return row


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


def _curve_options(server_key: str | None, client_key: str | None) -> CurveKeys | None:
    """The CLI's CURVE keys: `server_key` a public key file or Z85 text, `client_key` a secret key file.
    Raises `ValueError` naming the option for one that cannot be used."""
    if server_key is None:
        if client_key is not None:
            raise ValueError("--client-key needs --server-key (the server's public key)")
        return None
    public = server_key if len(server_key) == 40 and not os.path.exists(server_key) else None
    try:
        if public is None:
            public = load_key_file(server_key, secret=False)[0]
        own = None
        if client_key is not None:
            own_public, own_secret = load_key_file(client_key, secret=True)
            own = (own_public, own_secret or "")
        return client_keys(public, own)
    except ValueError as exc:
        raise ValueError(f"--server-key / --client-key: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m frontend.client", formatter_class=HelpFormatter,
                       description="Submit prompts to a running deltaserve engine and print the answers.")
    p.add_argument("prompts", nargs="*", help="prompt texts")
    p.add_argument("--prompt", action="append", default=[], dest="prompt_options", metavar="TEXT",
                   help="a prompt, as launch.py takes them (repeatable; after the positional prompts)")
    p.add_argument("--host", default="127.0.0.1", help="host of the engine (launch.py --serve --host)")
    p.add_argument("--port", type=int, default=8000, help="port of the engine (launch.py --serve --port), 1..65535")
    p.add_argument("--address", default=None, help="full ZMQ address (tcp://... or ipc://...), overrides host/port")
    p.add_argument("--max-tokens", type=int, default=64, help="most output tokens per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=None,
                   help="seed in [0, 2**63) that makes each prompt's samples reproducible (default: the engine's "
                        "own seeded stream)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    add_sampling_arguments(p)
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message of the chat template")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt when it finishes (a failed one with its error)")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds without any answer before giving up (> 0)")
    p.add_argument("--start-profile", nargs="?", type=int, const=0, default=None, metavar="STEPS",
                   help="start tracing every engine process at the next step, for at most STEPS steps (default: as "
                        "many as the engine's --profile-steps window holds); the engine needs --profile-dir")
    p.add_argument("--stop-profile", action="store_true",
                   help="stop the trace after the last step planned so far, wait until its files are written and "
                        "merged, and print the summary")
    p.add_argument("--server-key", default=None,
                   help="the server's CURVE public key (its .key file, or the 40-character key), for a server "
                        "started with --client-key")
    p.add_argument("--client-key", default=None,
                   help="this client's CURVE key pair (a .key_secret file), for a server that admits only listed "
                        "clients (--client-allowed-keys); default: a fresh pair")
    args = p.parse_args(argv)
    args.prompts += args.prompt_options
    profiling = args.start_profile is not None or args.stop_profile
    if profiling and (args.prompts or (args.start_profile is not None and args.stop_profile)):
        p.error("--start-profile and --stop-profile are used alone (no prompts, not both at once)")
    if not profiling and not args.prompts:
        p.error("give one or more prompts, or --start-profile / --stop-profile")
    if args.start_profile is not None and args.start_profile < 0:
        p.error(f"--start-profile STEPS must be >= 0, got {args.start_profile}")
    if not args.timeout > 0:  # also refuses NaN
        p.error(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    params = sampling_params_from_args(p, args, temperature=args.temperature, max_tokens=args.max_tokens,
                                       seed=args.seed, ignore_eos=args.ignore_eos)
    for n, text in enumerate(args.prompts, 1):
        where = undecodable_text(text)
        if where is not None:
            p.error(f"prompt argument {n} is not UTF-8 text: {where} cannot be decoded: give prompts in UTF-8")
    if args.address is None and not 0 < args.port < 65536:
        p.error(f"--port must be in 1..65535, got {args.port}")
    address = args.address or f"tcp://{args.host}:{args.port}"
    try:
        curve = _curve_options(args.server_key, args.client_key)
        client = EngineClient(address, dead_after_s=args.timeout, curve=curve)
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
    if profiling:
        return profile_command(client, args.start_profile, args.json)
    stream = len(args.prompts) == 1 and not args.json and params.n == 1
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
                results[out.request_id] = json_row(args.prompts[order[out.request_id]], out)
                if out.error:
                    if stream:  # end the line of the text streamed so far
                        print()
                    print(f"error: {out.error}", file=sys.stderr)
                    status = 1
                if args.json:  # every prompt, failed ones too: one object per prompt
                    print(json.dumps(results[out.request_id], ensure_ascii=False))
                elif not stream and not out.error:
                    for sample in out.outputs:
                        label = f" [sample {sample.index}]" if params.n > 1 else ""
                        print(f"--- {results[out.request_id]['prompt']}{label}\n{sample.text}\n")
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


def profile_command(client: EngineClient, start_steps: int | None, as_json: bool) -> int:
    """--start-profile (`start_steps` not None) or --stop-profile: ask, print the answer, close the client."""
    try:
        if start_steps is not None:
            status = client.start_profile(start_steps)
            text = (f"profiling session {status.session}: steps {status.first_step}..{status.last_step} at most "
                    f"(stop it with --stop-profile); files go to {status.folder}")
        else:
            status = client.stop_profile()
            text = status.summary or (f"profiling session {status.session} stopped after step {status.last_step}; "
                                      f"files in {status.folder}")
    except (RuntimeError, EngineConnectionError) as exc:  # the engine refused, or did not answer
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if as_json:
        print(json.dumps({"session": status.session, "first_step": status.first_step, "last_step": status.last_step,
                          "folder": status.folder, "summary": status.summary}, ensure_ascii=False))
    else:
        print(text, end="" if text.endswith("\n") else "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
