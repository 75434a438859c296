"""The frontend process: the engine's door to clients.

One loop: take client messages (ROUTER socket, one DEALER per client) -> validate and tokenize
each request -> forward it to the scheduler; take the scheduler's per-step token ids ->
detokenize incrementally -> send each client the news of its requests.

Liveness: clients ping this process; it and the scheduler ping each other every second.
A scheduler silent for DELTASERVE_SCHEDULER_TIMEOUT_S (stopped, or stuck without exiting, which
the launcher cannot see) fails every pending request and ends this process, and with it the engine.

Validation happens here, per request, before anything is queued: a bad request gets an error
output naming the limit, and the others in the same message go ahead.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from common import envs, ipc
from common.config import EngineConfig
from common.errors import ExplainedError
from common.limits import prompt_limit_error
from common.proc import engine_process_main, signal_name, stop_signals_deferred
from common.protocol import (
    ERROR_ENGINE_DOWN,
    ERROR_INVALID_REQUEST,
    Abort,
    AbortSeqs,
    AddRequests,
    Detokenize,
    DetokenizeResult,
    EngineInfo,
    EngineReady,
    EngineRequest,
    ErrorReply,
    GenerateRequest,
    GetEngineInfo,
    GetEngineStats,
    Ping,
    Pong,
    ProcessReady,
    ProtocolError,
    RequestOutput,
    RequestOutputs,
    StepOutputs,
    Submit,
    Tokenize,
    TokenizeResult,
    decode,
    encode,
    i32,
)
from common.sampling_params import SamplingParams
from frontend.detokenizer import IncrementalDetokenizer
from frontend.stats import EngineStatsCollector

log = logging.getLogger("deltaserve.frontend")
# While validating a long submission, clients hear a Pong this often (seconds), so that their silence
# timeout (20 s by default) does not take a busy frontend for a dead one.
KEEPALIVE_S = 0.5


def load_tokenizer(path: str) -> Any:
    """The fast tokenizer in folder `path`. Raises `ExplainedError` if there is none."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises several types for a folder without a tokenizer
        raise ExplainedError(f"cannot load a tokenizer from {path}: {type(exc).__name__}: {exc}") from exc
    if not getattr(tok, "is_fast", False):
        raise ExplainedError(f"the tokenizer in {path} has no fast (Rust) implementation, which the detokenizer needs")
    if len(tok) < 2:  # transformers builds an empty tokenizer for a folder without tokenizer files
        raise ExplainedError(f"no tokenizer in {path} (tokenizer.json, or vocab and merges files): "
                             f"pass --tokenizer DIR")
    return tok


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters any one token can stand for: a text longer than `max_model_len` times this
    has more than `max_model_len` tokens, so it is refused before it is tokenized."""
    return max(1, max(len(t) for t in tokenizer.get_vocab()))


def encode_prompt(tokenizer: Any, req: GenerateRequest, max_chars: int | None = None) -> list[int]:
    """Token ids of a request: `tokenizer(prompt)`, the chat template over `messages` (ending with the
    assistant turn's opening unless `req.add_generation_prompt` is false), or given ids.
    `req.add_special_tokens` (None: True for a prompt, False for messages, whose template writes its own).

    Raises `ValueError` if not exactly one of the three is set, one is malformed, the chat template
    refuses the messages, or a text is longer than `max_chars` characters (checked before tokenizing).
    """
    given = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(req, name) is not None]
    if len(given) != 1:
        raise ValueError(f"a request needs exactly one of prompt, prompt_token_ids, messages; got {given or 'none'}")
    if req.prompt_token_ids is not None:
        return list(req.prompt_token_ids)
    if req.prompt is not None:
        text, special = req.prompt, req.add_special_tokens is not False
    else:
        messages = req.messages
        if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                   and isinstance(m.get("content"), str) for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': str, 'content': str}")
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=bool(req.add_generation_prompt),
                                                 tokenize=False)
        except Exception as exc:  # jinja TemplateError (raise_exception), TypeError, UndefinedError, ...
            raise ValueError(f"the chat template refused these messages: {type(exc).__name__}: {exc}") from None
        special = bool(req.add_special_tokens)
    if max_chars is not None and len(text) > max_chars:
        raise ValueError(f"the prompt has {len(text)} characters: more than max_model_len tokens for sure "
                         f"(at most {max_chars} characters can fit)")
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


@dataclass
class RequestState:
    client: bytes
    request_id: str
    seq_id: int
    params: SamplingParams
    num_prompt_tokens: int
    detokenizer: IncrementalDetokenizer
    arrival_time: float
    stream: bool = False
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""


class FrontendProcess:
    def __init__(self, config: EngineConfig, endpoints: ipc.Endpoints) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.ctx = zmq.Context.instance()
        self.control = ipc.make_socket(self.ctx, zmq.PUSH, endpoints.control, bind=False)
        self.from_scheduler = ipc.make_socket(self.ctx, zmq.PULL, endpoints.frontend_in, bind=True)
        self.to_scheduler = ipc.make_socket(self.ctx, zmq.PUSH, endpoints.scheduler_in, bind=False)
        self.clients = ipc.make_socket(self.ctx, zmq.ROUTER, endpoints.client, bind=True, fd=endpoints.client_fd)
        self.last_seen: dict[bytes, float] = {}  # client identity -> time.monotonic() of its last message
        self.client_silence_s = envs.client_silence_s()
        self.scheduler_timeout_s = envs.scheduler_timeout_s()
        self.scheduler_last_heard = time.monotonic()
        self.client_address = endpoints.client
        self.endpoints = endpoints
        self.requests: dict[int, RequestState] = {}  # by seq_id
        self.by_client: dict[tuple[bytes, str], int] = {}  # (client, request_id) -> seq_id
        self.next_seq_id = 0
        eos = set(config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = sorted(eos)
        self.num_kv_blocks = 0
        self.block_size = config.block_size
        assert config.max_model_len is not None
        self.max_prompt_chars = config.max_model_len * longest_token_chars(self.tokenizer)
        self.ready_info: dict[str, Any] = {}
        self.stats = EngineStatsCollector(config.max_model_len)

    def start(self) -> None:
        msg = ipc.recv(self.from_scheduler)
        if not isinstance(msg, EngineReady):
            raise RuntimeError(f"expected EngineReady from the scheduler, got {type(msg).__name__}")
        self.num_kv_blocks, self.block_size = msg.num_kv_blocks, msg.block_size
        self.ready_info = dict(msg.info)
        ipc.send(self.control, ProcessReady("frontend", {"client": self.client_address, **self.engine_info_dict()}))

    def engine_info_dict(self) -> dict[str, Any]:
        return {"model": self.config.served_model_names[0], "max_model_len": self.config.max_model_len,
                "num_kv_blocks": self.num_kv_blocks, "block_size": self.block_size,
                "vocab_size": self.config.vocab_size, **self.ready_info}

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        """Run the loop until this process is stopped (SIGTERM becomes `SystemExit`, see
        `common.proc`) or fails; either way, every pending request first gets an error output, so that
        its client hears of the shutdown at once instead of waiting out its silence timeout."""
        try:
            self._serve_loop()
        except BaseException as exc:
            self._fail_pending(shutdown_reason(exc, self.endpoints.read_stop_reason()))
            raise

    def _serve_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.clients, zmq.POLLIN)
        poller.register(self.from_scheduler, zmq.POLLIN)
        next_check = time.monotonic() + 1.0
        self.scheduler_last_heard = time.monotonic()
        while True:
            events = dict(poller.poll(1000))
            if self.from_scheduler in events:
                for raw in ipc.recv_all(self.from_scheduler):
                    self._handle_scheduler(raw)
                self.scheduler_last_heard = time.monotonic()
            self._check_scheduler()  # right after reading its socket, before a long submission can delay us
            if self.clients in events:
                while True:
                    try:
                        client, *frames = self.clients.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) != 1:
                        self._reply(client, ErrorReply(f"a message is one frame, not {len(frames)}"))
                        continue
                    self._handle_client(client, frames[0])
            if time.monotonic() > next_check:  # after reading: pings queued behind a long submission count
                self._abort_silent_clients()
                ipc.send(self.to_scheduler, Ping())  # the scheduler takes a silent frontend for a stopped one
                next_check = time.monotonic() + 1.0

    def _reply(self, client: bytes, msg: object) -> None:
        data = encode(msg)
        with stop_signals_deferred:  # never half a message: _fail_pending sends more on this socket
            self.clients.send_multipart([client, data])

    def _abort_silent_clients(self) -> None:
        """Abort the requests of clients silent for `envs.client_silence_s()`: waiting clients ping every
        2 s, so such a client has gone away (crashed, or closed its socket) without aborting."""
        now = time.monotonic()
        gone = {c for c, t in self.last_seen.items() if now - t > self.client_silence_s}
        if not gone:
            return
        seq_ids = [seq for (c, _), seq in self.by_client.items() if c in gone]
        for c in gone:
            del self.last_seen[c]
        if seq_ids:
            log.warning("%d clients went silent: aborting their %d requests", len(gone), len(seq_ids))
            ipc.send(self.to_scheduler, AbortSeqs(seq_ids))

    def _check_scheduler(self) -> None:
        """Raise `SchedulerSilent` if the scheduler has sent nothing (not even its once-a-second ping)
        for DELTASERVE_SCHEDULER_TIMEOUT_S seconds; `serve` then gives every pending request that error.

        A stopped or stuck scheduler does not exit, so the launcher does not notice it, and clients
        would wait forever since this process keeps answering their pings. The raised error ends
        this process; the launcher then stops the others (resuming a stopped one) with its message.
        """
        silent = time.monotonic() - self.scheduler_last_heard
        if not self.scheduler_timeout_s or silent <= self.scheduler_timeout_s:
            return
        why = (f"the scheduler has sent nothing for {silent:.0f} s (DELTASERVE_SCHEDULER_TIMEOUT_S="
               f"{self.scheduler_timeout_s:g}): it is stopped or stuck, and the engine is shutting down")
        raise SchedulerSilent(why)

    def _fail_pending(self, why: str) -> None:
        """Finish every pending request with finish reason "error" and `why` (the text so far included),
        and make `close()` wait up to 2 s to deliver these outputs. Called once this process is ending:
        it never raises, so that the error ending the process is the one reported."""
        try:
            now = time.time()
            per_client: dict[bytes, list[RequestOutput]] = defaultdict(list)
            for st in self.requests.values():
                out = self._output(st, now, finished=True)
                out.finish_reason, out.error, out.error_type = "error", why, ERROR_ENGINE_DOWN
                per_client[st.client].append(out)
            self.requests.clear()
            self.by_client.clear()
            if per_client:
                log.warning("failing %d pending requests: %s", sum(map(len, per_client.values())), why)
            for client, outputs in per_client.items():
                self._reply(client, RequestOutputs(outputs))
            self.clients.setsockopt(zmq.LINGER, 2000)  # close() must not drop these errors
        except Exception:  # a broken socket must not hide why the process ends
            log.exception("could not tell the clients that the engine is shutting down")

    def _handle_client(self, client: bytes, raw: bytes) -> None:
        self.last_seen[client] = time.monotonic()
        try:
            msg = decode(raw)
        except ProtocolError as exc:
            log.warning("malformed message from a client: %s", exc)
            self._reply(client, ErrorReply(f"malformed message: {exc}"))
            return
        if isinstance(msg, Submit):
            self._submit(client, msg)
        elif isinstance(msg, Abort):
            seq_ids = [self.by_client[(client, rid)] for rid in msg.request_ids if (client, rid) in self.by_client]
            if seq_ids:
                ipc.send(self.to_scheduler, AbortSeqs(seq_ids))
        elif isinstance(msg, GetEngineInfo):
            info = self.engine_info_dict()
            self._reply(client, EngineInfo(info.pop("model"), info.pop("max_model_len"), info.pop("num_kv_blocks"),
                                           info.pop("block_size"), info.pop("vocab_size"), info,
                                           list(self.config.served_model_names)))
        elif isinstance(msg, GetEngineStats):
            self._reply(client, self.stats.snapshot(msg.reply_id))
        elif isinstance(msg, Tokenize):
            self._reply(client, self._tokenize(msg))
        elif isinstance(msg, Detokenize):
            self._reply(client, self._detokenize(msg))
        elif isinstance(msg, Ping):
            self._reply(client, Pong(msg.nonce))
        else:
            self._reply(client, ErrorReply(f"a client cannot send {type(msg).__name__}"))

    def _submit(self, client: bytes, msg: Submit) -> None:
        accepted: list[EngineRequest] = []
        rejected: list[RequestOutput] = []
        beat = time.monotonic()
        for req in msg.requests:
            if time.monotonic() - beat > KEEPALIVE_S:  # a long batch: tell waiting clients this engine lives
                beat = time.monotonic()
                for waiting in self.last_seen:
                    self._reply(waiting, Pong(0))
                ipc.send(self.to_scheduler, Ping())
            try:
                engine_req, state = self._validate(client, req)
            except ValueError as exc:
                rejected.append(RequestOutput(req.request_id, finished=True, finish_reason="error", error=str(exc),
                                              num_prompt_tokens=getattr(exc, "num_prompt_tokens", 0),
                                              error_type=ERROR_INVALID_REQUEST))
                self.stats.num_finished["error"] += 1
                continue
            self.requests[state.seq_id] = state
            self.by_client[(client, req.request_id)] = state.seq_id
            accepted.append(engine_req)
        if rejected and accepted and msg.all_or_nothing:  # the valid ones fail with the batch
            why = f"not run: request {rejected[0].request_id!r} of the same all-or-nothing submission was rejected"
            for engine_req in accepted:
                state = self.requests.pop(engine_req.seq_id)
                del self.by_client[(client, state.request_id)]
                rejected.append(RequestOutput(state.request_id, finished=True, finish_reason="error", error=why,
                                              error_type=ERROR_INVALID_REQUEST))
                self.stats.num_finished["error"] += 1
            accepted = []
        if accepted:
            ipc.send(self.to_scheduler, AddRequests(accepted))
        if rejected:
            self._reply(client, RequestOutputs(rejected))

    def _tokenize(self, msg: Tokenize) -> TokenizeResult:
        """The token ids `msg.request` would run with, or why it cannot be tokenized or run (too long, ...)."""
        try:
            ids = encode_prompt(self.tokenizer, msg.request, self.max_prompt_chars)
            arr = np.asarray(ids, dtype=np.int64)
        except (ValueError, OverflowError) as exc:
            return TokenizeResult(msg.reply_id, error=str(exc) if isinstance(exc, ValueError)
                                  else "a token id does not fit in 64 bits: out of the vocabulary")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= self.config.vocab_size):
            return TokenizeResult(msg.reply_id, error=f"token ids must be in [0, {self.config.vocab_size}); got min "
                                                      f"{int(arr.min())}, max {int(arr.max())}")
        return TokenizeResult(msg.reply_id, ids)

    def _detokenize(self, msg: Detokenize) -> DetokenizeResult:
        ids = msg.token_ids
        bad = next((t for t in ids if not 0 <= t < self.config.vocab_size), None)
        if bad is not None:
            return DetokenizeResult(msg.reply_id, error=f"token ids must be in [0, {self.config.vocab_size}); "
                                                        f"got {bad}")
        try:
            text = self.tokenizer.decode(ids, skip_special_tokens=msg.skip_special_tokens)
        except Exception as exc:  # the Rust tokenizer raises its own types (an id it has no piece for)
            return DetokenizeResult(msg.reply_id, error=f"cannot decode these token ids: {exc}")
        return DetokenizeResult(msg.reply_id, text)

    def _validate(self, client: bytes, req: GenerateRequest) -> tuple[EngineRequest, RequestState]:
        """Tokenize and check one request against the engine's limits. Raises `ValueError`."""
        if (client, req.request_id) in self.by_client:
            raise ValueError(f"request id {req.request_id!r} is already in use by a live request")
        params = SamplingParams.from_dict(req.sampling)
        ids = encode_prompt(self.tokenizer, req, self.max_prompt_chars)  # ints: the protocol checked given ids
        try:
            arr = np.asarray(ids, dtype=np.int64)
        except OverflowError:
            raise ValueError("a token id does not fit in 64 bits: out of the vocabulary") from None
        assert self.config.max_model_len is not None
        error = prompt_limit_error(arr, self.config.max_model_len, self.block_size, self.num_kv_blocks,
                                   self.config.vocab_size)
        if error is not None:
            raise PromptRejected(error, len(ids))
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        seq_id = self.next_seq_id
        self.next_seq_id += 1
        now = time.time()
        engine_req = EngineRequest(seq_id, i32(arr), float(params.temperature), params.max_tokens, params.seed,
                                   sorted(stop_ids), now)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        return engine_req, RequestState(client, req.request_id, seq_id, params, len(ids), detok, now,
                                        stream=req.stream)

    # ------------------------------------------------------------------ scheduler outputs
    def _handle_scheduler(self, raw: bytes) -> None:
        msg = decode(raw)
        if isinstance(msg, Ping):  # the scheduler's heartbeat
            return
        if not isinstance(msg, StepOutputs):
            log.error("unexpected %s from the scheduler", type(msg).__name__)
            return
        now = time.time()
        touched: dict[int, RequestState] = {}
        requests = self.requests
        stats = self.stats
        if msg.stats is not None:
            stats.scheduler = msg.stats
        observe_tpot = stats.tpot.observe
        for seq_id, token in zip(msg.seq_ids.tolist(), msg.token_ids.tolist()):
            st = requests.get(seq_id)
            if st is None:
                continue
            if st.first_token_time:
                observe_tpot(now - st.last_token_time)
            else:
                st.first_token_time = now
                stats.first_token(st.num_prompt_tokens, now - st.arrival_time)
            st.last_token_time = now
            st.num_output_tokens += 1
            stats.num_generation_tokens += 1
            piece = st.detokenizer.step(token)
            if st.stream:
                st.new_token_ids.append(token)
                st.new_text += piece
                touched[seq_id] = st
        for seq_id, cached in msg.num_cached_tokens.items():
            if seq_id in requests:
                requests[seq_id].num_cached_tokens = cached
        per_client: dict[bytes, list[RequestOutput]] = defaultdict(list)
        for fin in msg.finished:
            st = requests.pop(fin.seq_id, None)
            if st is None:
                continue
            touched.pop(fin.seq_id, None)
            self.by_client.pop((st.client, st.request_id), None)
            tail = st.detokenizer.flush()
            if st.stream:
                st.new_text += tail
            if fin.reason == "error":
                log.warning("request %s failed: %s", st.request_id, fin.error)
            out = self._output(st, now, finished=True)
            out.finish_reason, out.error = fin.reason, fin.error
            if fin.reason == "error":  # the scheduler refuses only requests that can never run
                out.error_type = ERROR_INVALID_REQUEST
            out.num_cached_tokens = fin.num_cached_tokens
            out.metrics["num_preemptions"] = fin.num_preemptions
            queue_s = fin.queue_time_s if fin.queue_time_s >= 0 else None
            if queue_s is not None:
                out.metrics["queue_s"] = queue_s
            stats.finished(fin.reason, st.num_prompt_tokens, st.num_output_tokens, now - st.arrival_time,
                           (st.first_token_time - st.arrival_time) if st.first_token_time else None, queue_s)
            per_client[st.client].append(out)
        for st in touched.values():  # streaming requests that got tokens and go on
            per_client[st.client].append(self._output(st, now, finished=False))
        for client, outputs in per_client.items():
            self._reply(client, RequestOutputs(outputs))

    def _output(self, st: RequestState, now: float, finished: bool) -> RequestOutput:
        """News of one request: the delta when streaming, the whole output when finished otherwise."""
        if st.stream:
            text, ids = st.new_text, st.new_token_ids
            st.new_text, st.new_token_ids = "", []
        else:
            text, ids = st.detokenizer.text, st.detokenizer.token_ids
        out = RequestOutput(st.request_id, text, ids, finished, None, None, st.num_prompt_tokens, st.num_cached_tokens)
        if finished:
            out.metrics = {"ttft_s": (st.first_token_time - st.arrival_time) if st.first_token_time else 0.0,
                           "e2e_s": now - st.arrival_time}
        return out

    def close(self) -> None:
        for sock in (self.control, self.from_scheduler, self.to_scheduler, self.clients):
            sock.close()
        if self.client_address.startswith("ipc://"):
            path = self.client_address[len("ipc://"):]
            if os.path.exists(path):
                os.unlink(path)


class PromptRejected(ValueError):
    """A tokenized prompt the engine cannot run; `num_prompt_tokens` is its length, reported to the client."""

    def __init__(self, message: str, num_prompt_tokens: int) -> None:
        super().__init__(message)
        self.num_prompt_tokens = num_prompt_tokens


class SchedulerSilent(ExplainedError):
    """The scheduler fell silent; the message is what clients are told."""


def shutdown_reason(exc: BaseException, launcher_reason: str | None = None) -> str:
    """What a client is told when this process ends by `exc`: a signal (`SystemExit(128 + signum)`,
    raised by `common.proc`), Ctrl-C, a silent scheduler, or an error.

    `launcher_reason`: why the launcher stopped the engine, if it said (`Endpoints.write_stop_reason`:
    another process died first); a signal is then told as that reason, since the launcher sent it."""
    if isinstance(exc, SchedulerSilent):
        return str(exc)
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else None
        if code is not None and code > 128 and launcher_reason:
            return f"the engine is shutting down: {launcher_reason}"
        if code is not None and code > 128:
            return f"the engine is shutting down (its frontend process got {signal_name(code - 128)})"
        return f"the engine is shutting down (its frontend process is exiting with code {exc.code})"
    if isinstance(exc, KeyboardInterrupt):
        return "the engine is shutting down (its frontend process was interrupted)"
    return f"the engine is shutting down: its frontend process failed: {type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> None:
    engine_process_main("frontend", "frontend", "deltaserve frontend process (started by launch.py)",
                        lambda config, endpoints, args: FrontendProcess(config, endpoints), argv)
