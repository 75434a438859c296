"""The frontend process: the engine's door to clients.

One loop: take client messages (ROUTER socket, one DEALER per client) -> validate and tokenize
each request -> forward it to the scheduler; take the scheduler's per-step token ids ->
detokenize incrementally -> send each client the news of its requests.

Liveness: clients ping this process; it and the scheduler ping each other every second.
A scheduler silent for DELTASERVE_SCHEDULER_TIMEOUT_S (stopped, or stuck without exiting, which
the launcher cannot see) fails every pending request and ends this process, and with it the engine.

Validation happens here, per request, before anything is queued: a bad request gets an error
output naming the limit, and the others in the same message go ahead.

A request of n samples takes the seq ids seq_id .. seq_id + n - 1 (the scheduler forks them); its
outputs gather every sample's news (frontend/outputs.py: stop strings, stop-token text, logprobs).
"""

from __future__ import annotations

import contextlib
import inspect
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
from common.errors import ExplainedError, quote, shorten
from common.limits import prompt_limit_error, token_id_range_error
from common.proc import engine_process_main, launcher_gone, signal_name, stop_signals_deferred
from common.profiling import FrontendProfiling, run_id_of
from common.protocol import (
    ERROR_ENGINE_DOWN,
    ERROR_INVALID_REQUEST,
    ERROR_OVERLOADED,
    MAX_REQUEST_ID_CHARS,
    NOT_RUN,
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
    PositionLogprobs,
    ProcessReady,
    ProfileStart,
    ProfileStatus,
    ProfileStop,
    ProtocolError,
    RequestOutput,
    RequestOutputs,
    SamplingOptions,
    StartProfile,
    StepOutputs,
    StopProfile,
    Submit,
    Tokenize,
    TokenizeResult,
    decode,
    encode,
    i32,
)
from common.sampling_params import SamplingParams
from common.units import count
from frontend.outputs import SampleState, TokenTexts, prompt_logprobs_of, sampled_logprobs
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
    """Token ids of a request: `tokenizer(prompt)`, the chat template over `messages` (with the request's
    `add_generation_prompt`, `continue_final_message` and `chat_template_kwargs`), or given ids.
    `req.add_special_tokens` (None: True for a prompt, False for messages, whose template writes its own).

    Raises `ValueError` if not exactly one of the three is set, one is malformed, the chat template
    refuses the messages (or its options contradict each other), or a text is longer than `max_chars`
    characters (checked before tokenizing).
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
        if req.add_generation_prompt and req.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true: the first "
                             "opens a new assistant turn, the second continues the last message")
        own = sorted(set(req.chat_template_kwargs) & set(inspect.signature(tokenizer.apply_chat_template).parameters))
        if own:
            raise ValueError(f"chat_template_kwargs cannot set {own}: they are arguments of the template call, not "
                             "template variables")
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                 continue_final_message=req.continue_final_message, tokenize=False,
                                                 **req.chat_template_kwargs)
        except Exception as exc:  # jinja TemplateError (raise_exception), TypeError, UndefinedError, ...
            why = f"the chat template refused these messages: {type(exc).__name__}: {exc}"
            raise ValueError(shorten(why)) from None
        special = bool(req.add_special_tokens)
    if max_chars is not None and len(text) > max_chars:
        raise ValueError(f"the prompt has {len(text)} characters: more than max_model_len tokens for sure "
                         f"(at most {max_chars} characters can fit)")
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


@dataclass
class RequestState:
    client: bytes
    request_id: str
    seq_id: int  # of sample 0; sample i has seq_id + i
    params: SamplingParams
    num_prompt_tokens: int
    samples: list[SampleState]
    arrival_time: float
    prompt_token_ids: list[int] = field(default_factory=list)
    stream: bool = False
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error: str | None = None
    num_unfinished: int = 1
    queue_s: float | None = None  # sample 0's time from arrival to its first scheduling, once it finished
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # position 0 is None
    prompt_logprobs_sent: bool = False


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids, alone and after a space (vLLM's rule: the spaced form counts only when
    it begins with another token and has as many tokens, i.e. a space-joined variant of the word)."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        for ids in (bare, spaced) if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare) else (
                bare,):
            if ids and ids not in out:
                out.append(ids)
    return out


class FrontendProcess:
    def __init__(self, config: EngineConfig, endpoints: ipc.Endpoints) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.ctx = zmq.Context.instance()
        self.control = endpoints.make_socket(self.ctx, zmq.PUSH, endpoints.control, bind=False)
        self.from_scheduler = endpoints.make_socket(self.ctx, zmq.PULL, endpoints.frontend_in, bind=True)
        self.to_scheduler = endpoints.make_socket(self.ctx, zmq.PUSH, endpoints.scheduler_in, bind=False)
        self.clients = endpoints.make_socket(self.ctx, zmq.ROUTER, endpoints.client, bind=True,
                                             max_message_bytes=config.max_message_bytes)
        self.last_seen: dict[bytes, float] = {}  # client identity -> time.monotonic() of its last message
        self.client_silence_s = envs.client_silence_s()
        self.scheduler_timeout_s = envs.scheduler_timeout_s()
        self.scheduler_last_heard = time.monotonic()
        self.client_address = endpoints.client
        self.endpoints = endpoints
        self.requests: dict[int, RequestState] = {}  # by the seq id of sample 0
        self.samples: dict[int, tuple[RequestState, SampleState]] = {}  # by seq id, while the sample runs
        self.not_started: set[int] = set()  # sample 0's seq ids of requests without a first token yet
        self.by_client: dict[tuple[bytes, str], int] = {}  # (client, request_id) -> seq id of sample 0
        self.token_texts = TokenTexts(self.tokenizer)
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
        self.profiling = FrontendProfiling(config, run_id_of(endpoints.run_dir), self._reply,
                                           lambda msg: ipc.send(self.to_scheduler, msg))
        self.phases = self.profiling.phases
        self.stats = EngineStatsCollector(config.max_model_len)

    def start(self) -> None:
        msg = ipc.recv(self.from_scheduler)
        if not isinstance(msg, EngineReady):
            raise RuntimeError(f"expected EngineReady from the scheduler, got {type(msg).__name__}")
        self.num_kv_blocks, self.block_size = msg.num_kv_blocks, msg.block_size
        self.ready_info = dict(msg.info)
        ipc.send(self.control, ProcessReady("frontend", {"client": self.client_address, **self.engine_info_dict()}))

    def engine_info_dict(self) -> dict[str, Any]:
        eos = self.tokenizer.eos_token_id  # the HTTP server's stop_reason is None at this one (vLLM's rule)
        return {"model": self.config.served_model_names[0], "max_model_len": self.config.max_model_len,
                "num_kv_blocks": self.num_kv_blocks, "block_size": self.block_size,
                "vocab_size": self.config.vocab_size, "max_message_bytes": self.config.max_message_bytes,
                "max_waiting_requests": self.config.max_waiting_requests,
                "eos_token_id": None if eos is None else int(eos), **self.ready_info}

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        """Run the loop until this process is stopped (SIGTERM becomes `SystemExit`, see
        `common.proc`) or fails; either way, every pending request first gets an error output, so that
        its client hears of the shutdown at once instead of waiting out its silence timeout."""
        try:
            self._serve_loop()
        except BaseException as exc:
            why = self.endpoints.read_stop_reason() or (LAUNCHER_GONE if launcher_gone() else None)
            self._fail_pending(shutdown_reason(exc, why))
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
                self.profiling.poll()
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
        seq_ids = [seq for (c, _), base in self.by_client.items() if c in gone for seq in self._sample_seq_ids(base)]
        for c in gone:
            del self.last_seen[c]
        if seq_ids:
            log.warning("%s went silent: aborting their %s", count(len(gone), "client"), count(len(seq_ids), "request"))
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
                for sample in st.samples:
                    sample.finish("error")
                st.error = why
                out = self._output(st, now, finished=True)
                out.error_type = ERROR_ENGINE_DOWN
                per_client[st.client].append(out)
            self.requests.clear()
            self.samples.clear()
            self.by_client.clear()
            self.not_started.clear()
            if per_client:
                log.warning("failing %s: %s", count(sum(map(len, per_client.values())), "pending request"), why)
            for client, outputs in per_client.items():
                self._reply(client, RequestOutputs(outputs))
            self.clients.setsockopt(zmq.LINGER, 2000)  # close() must not drop these errors
        except Exception:  # a broken socket must not hide why the process ends
            log.exception("could not tell the clients that the engine is shutting down")

    def _handle_client(self, client: bytes, raw: bytes) -> None:
        self.last_seen[client] = time.monotonic()
        try:
            msg = decode(raw)
        except ProtocolError as exc:  # the message quotes at most a few hundred characters of the input
            log.warning("malformed message from a client: %s", shorten(str(exc)))
            self._reply(client, ErrorReply(shorten(f"malformed message: {exc}")))
            return
        if isinstance(msg, Submit):
            self._submit(client, msg)
        elif isinstance(msg, Abort):
            seq_ids = [seq for rid in msg.request_ids if (client, rid) in self.by_client
                       for seq in self._sample_seq_ids(self.by_client[(client, rid)])]
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
        elif isinstance(msg, (StartProfile, StopProfile)):
            self.profiling.request(client, msg)
        else:
            self._reply(client, ErrorReply(f"a client cannot send {type(msg).__name__}"))

    def _submit(self, client: bytes, msg: Submit) -> None:
        self.phases.begin("tokenize")
        accepted: list[EngineRequest] = []
        rejected: list[RequestOutput] = []
        taken: list[str] = []  # ids of live requests: refused apart, so that no output reads as the live one's
        beat = time.monotonic()
        cap = self.config.max_waiting_requests
        for i, req in enumerate(msg.requests):
            if len(req.request_id) > MAX_REQUEST_ID_CHARS:  # not echoed back: the client gets no output for it
                self._reply(client, ErrorReply(f"request {i} of the submission is refused: its request_id has "
                                               f"{len(req.request_id)} characters, at most {MAX_REQUEST_ID_CHARS} "
                                               f"are allowed ({quote(req.request_id)})"))
                continue
            if cap is not None and len(self.not_started) + len(accepted) >= cap:  # refused before any work
                rejected.append(RequestOutput(req.request_id, finished=True, finish_reason="error", error=(
                    f"the engine is overloaded: {len(self.not_started) + len(accepted)} requests are waiting to start, "
                    f"the most max_waiting_requests (--max-waiting-requests) allows is {cap}; try again later"),
                    error_type=ERROR_OVERLOADED))
                continue
            if time.monotonic() - beat > KEEPALIVE_S:  # a long batch: tell waiting clients this engine lives
                beat = time.monotonic()
                for waiting in self.last_seen:
                    self._reply(waiting, Pong(0))
                ipc.send(self.to_scheduler, Ping())
            if (client, req.request_id) in self.by_client:
                taken.append(req.request_id)
                continue
            try:
                engine_req, state = self._validate(client, req)
            except ValueError as exc:
                rejected.append(RequestOutput(req.request_id, finished=True, finish_reason="error",
                                              error=shorten(str(exc)),
                                              num_prompt_tokens=getattr(exc, "num_prompt_tokens", 0),
                                              error_type=ERROR_INVALID_REQUEST))
                self.stats.num_finished["error"] += 1
                continue
            self._register(state)
            accepted.append(engine_req)
        if (rejected or taken) and accepted and msg.all_or_nothing:  # the valid ones fail with the batch
            first = rejected[0].request_id if rejected else taken[0]
            why = f"{NOT_RUN}request {quote(first)} of the same all-or-nothing submission was rejected"
            for engine_req in accepted:
                state = self.requests.pop(engine_req.seq_id)
                del self.by_client[(client, state.request_id)]
                for i in range(len(state.samples)):
                    del self.samples[state.seq_id + i]
                rejected.append(RequestOutput(state.request_id, finished=True, finish_reason="error", error=why,
                                              error_type=rejected[0].error_type if rejected else ERROR_INVALID_REQUEST))
                self.stats.num_finished["error"] += 1
            accepted = []
        if accepted:
            self.not_started.update(r.seq_id for r in accepted)
            ipc.send(self.to_scheduler, AddRequests(accepted))
        if rejected:
            self._reply(client, RequestOutputs(rejected))
        if taken:
            self._reply(client, ErrorReply(
                f"refused {count(len(taken), 'submitted request')} without running: the id of each is that of a "
                f"live request of this client, which goes on (a request id must be unique among the client's live "
                f"requests): {quote(taken)}", refused_request_ids=taken))
        self.phases.end()

    def _register(self, state: RequestState) -> None:
        self.requests[state.seq_id] = state
        self.by_client[(state.client, state.request_id)] = state.seq_id
        for sample in state.samples:
            self.samples[state.seq_id + sample.index] = (state, sample)

    def _sample_seq_ids(self, base: int) -> list[int]:
        """The seq ids of the samples of request `base` that still run."""
        st = self.requests.get(base)
        return [] if st is None else [base + s.index for s in st.samples if not s.finished]

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
        params = SamplingParams.from_dict(req.sampling)
        vocab = self.config.vocab_size
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n must be in [1, max_num_seqs={self.config.max_num_seqs}] (the samples run at "
                             f"once), got {params.n}")
        bad_bias = sorted(t for t in params.logit_bias or {} if t >= vocab)
        if bad_bias:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab}), got {bad_bias[0]}")
        ids = encode_prompt(self.tokenizer, req, self.max_prompt_chars)  # ints: the protocol checked given ids
        try:
            arr = np.asarray(ids, dtype=np.int64)
        except OverflowError:  # an id past 2**63 (a numpy uint64, say): out of the vocabulary all the same
            raise PromptRejected(token_id_range_error(min(ids), max(ids), self.config.vocab_size)
                                 or f"prompt token ids must be in [0, 2**63); got min {min(ids)}, max {max(ids)}",
                                 len(ids)) from None
        assert self.config.max_model_len is not None
        error = prompt_limit_error(arr, self.config.max_model_len, self.block_size, self.num_kv_blocks, vocab)
        if error is not None:
            raise PromptRejected(error, len(ids))
        if req.max_tokens_within_context and len(ids) + params.max_tokens > self.config.max_model_len:
            raise PromptRejected(context_length_error(len(ids), params.max_tokens, self.config.max_model_len,
                                                      "messages" if req.messages is not None else "prompt"), len(ids))
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        seq_id = self.next_seq_id
        self.next_seq_id += params.n
        now = time.time()
        temperature = 0.0 if params.greedy else float(params.temperature)
        grammar = params.structured_outputs.grammar_spec() if params.structured_outputs is not None else None
        engine_req = EngineRequest(seq_id, i32(arr), temperature, params.max_tokens, params.seed, sorted(stop_ids),
                                   now, self._options(params, stop_ids), params.n, grammar)
        samples = [SampleState(i, self.tokenizer, ids, params) for i in range(params.n)]
        state = RequestState(client, req.request_id, seq_id, params, len(ids), samples, now, ids, stream=req.stream,
                             num_unfinished=params.n,
                             prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        return engine_req, state

    def _options(self, params: SamplingParams, stop_ids: set[int]) -> SamplingOptions | None:
        """What the workers must apply, or None for a request that uses only temperature. Greedy requests
        drop top_k, top_p and min_p (an argmax stays the argmax); ids past the vocabulary cannot be
        sampled, so they are not masked."""
        vocab = self.config.vocab_size
        greedy = params.greedy
        options = SamplingOptions(
            top_k=0 if greedy or params.top_k <= 0 or params.top_k >= vocab else params.top_k,
            top_p=1.0 if greedy else float(params.top_p),
            min_p=0.0 if greedy else float(params.min_p),
            presence_penalty=float(params.presence_penalty),
            frequency_penalty=float(params.frequency_penalty),
            repetition_penalty=float(params.repetition_penalty),
            logit_bias=dict(params.logit_bias or {}),
            bad_words=[w for w in bad_words_token_ids(self.tokenizer, params.bad_words or []) if max(w) < vocab],
            min_tokens=params.min_tokens,
            stop_token_ids=sorted(t for t in stop_ids if t < vocab) if params.min_tokens else [],
            logprobs=-1 if params.logprobs is None else params.logprobs,
            prompt_logprobs=-1 if params.prompt_logprobs is None else params.prompt_logprobs,
        )
        return None if options == SamplingOptions() else options

    # ------------------------------------------------------------------ scheduler outputs
    def _handle_scheduler(self, raw: bytes) -> None:
        msg = decode(raw)
        if isinstance(msg, Ping):  # the scheduler's heartbeat
            return
        if isinstance(msg, (ProfileStart, ProfileStop, ProfileStatus)):
            self.profiling.from_scheduler(msg)
            return
        if not isinstance(msg, StepOutputs):
            log.error("unexpected %s from the scheduler", type(msg).__name__)
            return
        self.phases.begin("detokenize", msg.step_id)
        now = time.time()
        touched: dict[int, RequestState] = {}
        samples = self.samples
        stats = self.stats
        if msg.stats is not None:
            stats.scheduler = msg.stats
        observe_tpot = stats.tpot.observe
        stopping = {fin.seq_id for fin in msg.finished if fin.reason == "stop"}  # by their last token, in this step
        logprobs = sampled_logprobs(msg.logprobs, msg.token_ids, self.token_texts)
        stopped_by_text: list[int] = []
        for i, (seq_id, token) in enumerate(zip(msg.seq_ids.tolist(), msg.token_ids.tolist())):
            entry = samples.get(seq_id)
            if entry is None:
                continue  # finished already (a stop string, an abort): a late token
            st, sample = entry
            if not st.first_token_time:
                st.first_token_time = st.last_token_time = now
                self.not_started.discard(st.seq_id)
                stats.first_token(st.num_prompt_tokens, now - st.arrival_time)
            elif seq_id == st.seq_id:  # time per output token: along sample 0 (the others step with it)
                observe_tpot(now - st.last_token_time)
                st.last_token_time = now
            st.num_output_tokens += 1
            stats.num_generation_tokens += 1
            if sample.add(token, logprobs.get(i), stop_token=seq_id in stopping):
                del samples[seq_id]  # a stop string: the scheduler aborts it, and its later news is dropped
                st.num_unfinished -= 1
                stopped_by_text.append(seq_id)
            touched[st.seq_id] = st
        if msg.prompt_logprobs is not None:
            prompts = {seq: (st.prompt_token_ids, st.prompt_logprobs) for seq, st in self.requests.items()
                       if st.prompt_logprobs is not None}
            prompt_logprobs_of(msg.prompt_logprobs, prompts, self.token_texts)
        for seq_id, cached in msg.num_cached_tokens.items():
            if seq_id in self.requests:
                self.requests[seq_id].num_cached_tokens = cached
        for fin in msg.finished:
            entry = samples.pop(fin.seq_id, None)
            if entry is None:
                continue
            st, sample = entry
            sample.finish(fin.reason)
            st.num_unfinished -= 1
            st.num_preemptions += fin.num_preemptions
            if fin.seq_id == st.seq_id:
                st.num_cached_tokens = fin.num_cached_tokens
            if fin.reason == "error":
                log.warning("request %s failed: %s", st.request_id, fin.error)
                st.error = st.error or fin.error
            if fin.seq_id == st.seq_id and fin.queue_time_s >= 0:
                st.queue_s = fin.queue_time_s
            touched[st.seq_id] = st
        if stopped_by_text:
            ipc.send(self.to_scheduler, AbortSeqs(stopped_by_text))
        per_client: dict[bytes, list[RequestOutput]] = defaultdict(list)
        for st in touched.values():
            if st.num_unfinished == 0:
                del self.requests[st.seq_id]
                self.by_client.pop((st.client, st.request_id), None)
                self.not_started.discard(st.seq_id)
                out = self._output(st, now, finished=True)
                if st.error is not None:  # the scheduler refuses only requests that can never run
                    out.error_type = ERROR_INVALID_REQUEST
                if st.queue_s is not None:
                    out.metrics["queue_s"] = st.queue_s
                stats.finished(out.finish_reason or "abort", st.num_prompt_tokens, st.num_output_tokens,
                               now - st.arrival_time,
                               (st.first_token_time - st.arrival_time) if st.first_token_time else None, st.queue_s)
                per_client[st.client].append(out)
            elif st.stream and any(s.has_news() for s in st.samples):
                per_client[st.client].append(self._output(st, now, finished=False))
        self.phases.begin("send to clients", msg.step_id)
        for client, outputs in per_client.items():
            self._reply(client, RequestOutputs(outputs))
        self.phases.end()

    def _output(self, st: RequestState, now: float, finished: bool) -> RequestOutput:
        """News of one request: every sample's delta when streaming, the whole output when finished
        otherwise. Prompt logprobs go in the first output of a streamed request, else in the last."""
        if st.stream:
            outs = [s.take(stream=True) for s in st.samples if s.has_news()] or [st.samples[0].take(stream=True)]
        else:
            outs = [s.take(stream=False) for s in st.samples]
        first = outs[0]
        prompt_logprobs = None
        if st.prompt_logprobs is not None and not st.prompt_logprobs_sent and (st.stream or finished):
            prompt_logprobs, st.prompt_logprobs_sent = st.prompt_logprobs, True
        out = RequestOutput(st.request_id, first.text, first.token_ids, finished, first.finish_reason,
                            st.error if finished else None, st.num_prompt_tokens, st.num_cached_tokens, {},
                            first.stop_reason, first.logprobs, first.cumulative_logprob, prompt_logprobs, first.index,
                            outs[1:])
        if finished:
            out.metrics = {"ttft_s": (st.first_token_time - st.arrival_time) if st.first_token_time else 0.0,
                           "e2e_s": now - st.arrival_time, "num_preemptions": st.num_preemptions}
        return out

    def close(self) -> None:
        self.profiling.close()
        for sock in (self.control, self.from_scheduler, self.to_scheduler, self.clients):
            sock.close()
        if self.client_address.startswith("ipc://"):
            # The launcher may be removing the whole run folder at this moment: a file already gone is fine.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.client_address[len("ipc://"):])


LAUNCHER_GONE = "the launcher (the engine's parent process) is gone: it was killed or crashed"


def context_length_error(num_prompt_tokens: int, max_tokens: int, max_model_len: int, where: str) -> str:
    """vLLM's words for a request whose prompt and max_tokens do not fit in the context together."""
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {where}, {max_tokens} in the "
            f"completion). Please reduce the length of the {where} or completion.")


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
