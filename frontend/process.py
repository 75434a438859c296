"""The frontend process: the engine's door to clients.

One loop: take client messages (ROUTER socket, one DEALER per client) -> validate and tokenize
each request -> forward it to the scheduler; take the scheduler's per-step token ids ->
detokenize incrementally -> send each client the news of its requests.

Liveness: clients ping this process; it and the scheduler ping each other every second.
A scheduler silent for DELTASERVE_SCHEDULER_TIMEOUT_S (stopped, or stuck without exiting, which
the launcher cannot see) fails every pending request and ends this process, and with it the engine.

Each request is validated before anything is queued (frontend/validation.py: what a request becomes):
a bad request gets an error output naming the limit, and the others in the same message go ahead.

A request of n samples takes the seq ids seq_id .. seq_id + n - 1 (the scheduler forks them); its
outputs gather every sample's news (frontend/outputs.py: stop strings, stop-token text, logprobs).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import defaultdict
from typing import Any

import zmq

from common import envs, ipc
from common.config import EngineConfig
from common.errors import ExplainedError, quote, shorten
from common.proc import (
    engine_process_main,
    launcher_gone,
    signal_name,
    stop_signals_deferred,
    torch_threads,
    trim_heap,
)
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
    GetEngineInfo,
    GetEngineStats,
    Ping,
    Pong,
    ProcessReady,
    ProfileStart,
    ProfileStatus,
    ProfileStop,
    ProtocolError,
    RequestOutput,
    RequestOutputs,
    StartProfile,
    StepOutputs,
    StopProfile,
    Submit,
    Tokenize,
    decode,
    encode,
)
from common.units import count
from frontend.outputs import SampleState, TokenTexts, prompt_logprobs_of, sampled_logprobs
from frontend.stats import EngineStatsCollector
from frontend.validation import RequestState, RequestValidator, load_tokenizer

log = logging.getLogger("deltaserve.frontend")
# While validating a long submission, clients hear a Pong this often (seconds), so that their silence
# timeout (20 s by default) does not take a busy frontend for a dead one.
KEEPALIVE_S = 0.5


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
        self.validator = RequestValidator(config, self.tokenizer)
        self.ready_info: dict[str, Any] = {}
        self.profiling = FrontendProfiling(config, run_id_of(endpoints.run_dir), self._reply,
                                           lambda msg: ipc.send(self.to_scheduler, msg))
        self.phases = self.profiling.phases
        self.stats = EngineStatsCollector(config.max_model_len)

    def start(self) -> None:
        msg = ipc.recv(self.from_scheduler)
        if not isinstance(msg, EngineReady):
            raise RuntimeError(f"expected EngineReady from the scheduler, got {type(msg).__name__}")
        self.validator.num_kv_blocks, self.validator.block_size = msg.num_kv_blocks, msg.block_size
        self.ready_info = dict(msg.info)
        ipc.send(self.control, ProcessReady("frontend", {"client": self.client_address, **self.engine_info_dict(),
                                                         "torch_threads": torch_threads()}))

    def engine_info_dict(self) -> dict[str, Any]:
        eos = self.tokenizer.eos_token_id  # the HTTP server's stop_reason is None at this one (vLLM's rule)
        return {"model": self.config.served_model_names[0], "max_model_len": self.config.max_model_len,
                "num_kv_blocks": self.validator.num_kv_blocks, "block_size": self.validator.block_size,
                "vocab_size": self.config.vocab_size, "max_message_bytes": self.config.max_message_bytes,
                "max_waiting_requests": self.config.max_waiting_requests, "deterministic": self.config.deterministic,
                "max_steps_in_flight": self.config.max_steps_in_flight,
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
                if not self.requests:
                    trim_heap()
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
        """Answer one client message. Every message but an `Abort` gets a reply, and every request of a
        `Submit` its output or a refusal (docs/failures.md: every request message is answered): a fault
        of this process's while handling one message is logged and told to its sender as an `ErrorReply`,
        instead of leaving the client waiting or ending the engine."""
        self.last_seen[client] = time.monotonic()
        try:
            msg = decode(raw)
        except ProtocolError as exc:  # the message quotes at most a few hundred characters of the input
            log.warning("malformed message from a client: %s", shorten(str(exc)))
            self._reply(client, ErrorReply(shorten(f"malformed message: {exc}")))
            return
        try:
            self._dispatch(client, msg)
        except zmq.ZMQError:  # this process's sockets are broken: it cannot serve anyone
            raise
        except Exception as exc:
            log.exception("failed on a %s from a client", type(msg).__name__)
            self._reply(client, ErrorReply(shorten(f"{INTERNAL_ERROR}{type(msg).__name__}: {type(exc).__name__}: "
                                                   f"{exc}")))

    def _dispatch(self, client: bytes, msg: object) -> None:
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
            self._reply(client, self.validator.tokenize(msg))
        elif isinstance(msg, Detokenize):
            self._reply(client, self._detokenize(msg))
        elif isinstance(msg, Ping):
            self._reply(client, Pong(msg.nonce))
        elif isinstance(msg, (StartProfile, StopProfile)):
            self.profiling.request(client, msg)
        else:
            self._reply(client, ErrorReply(f"a client cannot send {type(msg).__name__}"))

    def _submit(self, client: bytes, msg: Submit) -> None:
        """Validate each request of `msg`, then register and forward the accepted ones together: nothing is
        registered before every request has its verdict, so no request can be left registered but unsent."""
        if not msg.requests:
            self._reply(client, ErrorReply("Submit.requests is empty: a submission needs at least one request"))
            return
        self.phases.begin("tokenize")
        accepted: list[tuple[EngineRequest, RequestState]] = []
        rejected: list[RequestOutput] = []
        taken: list[str] = []  # ids of live requests: refused apart, so that no output reads as the live one's
        accepted_ids: set[str] = set()
        beat = time.monotonic()
        cap = self.config.max_waiting_requests
        for i, req in enumerate(msg.requests):
            if len(req.request_id) > MAX_REQUEST_ID_CHARS:  # not echoed back: the client gets no output for it
                self._reply(client, ErrorReply(f"Submit.requests[{i}] is refused: its request_id has "
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
            if (client, req.request_id) in self.by_client or req.request_id in accepted_ids:
                taken.append(req.request_id)
                continue
            try:
                accepted.append(self.validator.validate(client, req))
            except ValueError as exc:
                rejected.append(self._refused(req.request_id, str(exc), getattr(exc, "num_prompt_tokens", 0)))
                continue
            except Exception as exc:  # a fault of ours, told to this request's client alone
                log.exception("failed validating request %s", quote(req.request_id))
                rejected.append(self._refused(req.request_id, f"{INTERNAL_ERROR}{type(exc).__name__}: {exc}"))
                continue
            accepted_ids.add(req.request_id)
        if (rejected or taken) and accepted and msg.all_or_nothing:  # the valid ones fail with the batch
            first = rejected[0].request_id if rejected else taken[0]
            why = f"{NOT_RUN}request {quote(first)} of the same all-or-nothing submission was rejected"
            error_type = rejected[0].error_type if rejected else ERROR_INVALID_REQUEST
            for _, state in accepted:
                rejected.append(self._refused(state.request_id, why))
                rejected[-1].error_type = error_type
            accepted = []
        for _, state in accepted:
            self._register(state)
        if accepted:
            self.not_started.update(r.seq_id for r, _ in accepted)
            ipc.send(self.to_scheduler, AddRequests([r for r, _ in accepted]))
        if rejected:
            self._reply(client, RequestOutputs(rejected))
        if taken:
            self._reply(client, ErrorReply(
                f"refused {count(len(taken), 'submitted request')} without running: the id of each is that of a "
                f"live request of this client, or of an earlier request of the same submission (a request id must "
                f"be unique among the client's live requests): {quote(taken)}", refused_request_ids=taken))
        self.phases.end()

    def _refused(self, request_id: str, why: str, num_prompt_tokens: int = 0) -> RequestOutput:
        """The one output of a request refused before it was queued (counted as finished with an error)."""
        self.stats.num_finished["error"] += 1
        return RequestOutput(request_id, finished=True, finish_reason="error", error=shorten(why),
                             num_prompt_tokens=num_prompt_tokens, error_type=ERROR_INVALID_REQUEST)

    def _register(self, state: RequestState) -> None:
        self.requests[state.seq_id] = state
        self.by_client[(state.client, state.request_id)] = state.seq_id
        for sample in state.samples:
            self.samples[state.seq_id + sample.index] = (state, sample)

    def _sample_seq_ids(self, base: int) -> list[int]:
        """The seq ids of the samples of request `base` that still run."""
        st = self.requests.get(base)
        return [] if st is None else [base + s.index for s in st.samples if not s.finished]

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
            if fin.structured_output_incomplete and sample.finish_reason == "length":
                sample.structured_output_incomplete = True
                log.warning("request %s%s stopped at max_tokens (finish reason length) before its structured output "
                            "was complete: its text does not match the constraint (raise max_tokens, or bound the "
                            "schema: docs/parameters.md)", st.request_id,
                            f" (sample {sample.index})" if len(st.samples) > 1 else "")
            st.num_unfinished -= 1
            st.num_preemptions += fin.num_preemptions
            if fin.seq_id == st.seq_id:
                st.num_cached_tokens = fin.num_cached_tokens
            if fin.reason == "error":
                # a request's own failure (its input, its grammar): the client is told; the engine serves on
                log.info("request %s failed: %s", st.request_id, fin.error)
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
                            outs[1:], structured_output_incomplete=first.structured_output_incomplete,
                            prompt_reasoning=st.prompt_reasoning)
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


# The start of the error of a message or request this process failed on (a bug, logged with its traceback).
INTERNAL_ERROR = "internal error of the frontend (a bug; logged): "
LAUNCHER_GONE = "the launcher (the engine's parent process) is gone: it was killed or crashed"


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
