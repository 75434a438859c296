"""Client <-> frontend (a client's DEALER socket to the frontend's ROUTER, `Endpoints.client`): requests,
their outputs, and the questions a client may ask (engine info, stats, tokenize, detokenize, ping).

A client is `EngineClient`, `LLM`, or an HTTP server process (`frontend/openai/`, through
`AsyncEngineClient`); all speak these messages. Token ids here are plain lists of ints, text is what the
tokenizer decodes, times are in seconds.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

import numpy as np

from common.gc_pause import collector_paused
from common.protocol.codec import ProtocolError, f32, i32, wire_form, wire_message, wire_struct
from common.protocol.types import SchedulerStats


@wire_struct
class GenerateRequest:
    """One prompt. Exactly one of `prompt`, `prompt_token_ids`, `messages` is set."""

    request_id: str  # chosen by the client, unique among its live requests
    prompt: str | None = None  # encoded as tokenizer(prompt) would
    prompt_token_ids: list[int] | None = None  # [prompt_len], run as given
    messages: list[dict[str, Any]] | None = None  # chat messages, rendered by the chat template
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields
    stream: bool = False  # True: an output per step; False: one output when finished
    # For `messages` only (transformers' apply_chat_template arguments, vLLM's names and defaults):
    add_generation_prompt: bool = True  # end the text with the opening of the assistant's turn
    continue_final_message: bool = False  # leave the last message open, for the model to continue it
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra template variables (enable_thinking)
    add_special_tokens: bool | None = None  # None: True for `prompt` (as tokenizer() does), False for `messages`
    # Refuse the request when prompt + max_tokens exceeds max_model_len, instead of stopping it there with
    # finish reason "length": the OpenAI server's rule for a max_tokens the client gave (vLLM answers 400).
    max_tokens_within_context: bool = False
    # For `messages` only: the tools the chat template shows the model, in OpenAI's shape ({"type": "function",
    # "function": {"name", "description", "parameters"}}); refused when the template renders no tools.
    tools: list[dict[str, Any]] | None = None


NOT_RUN = "not run: "  # the error of a valid request of an all-or-nothing submission that another one sank


@wire_message
class Submit:
    """Client -> frontend: new requests. With `all_or_nothing`, one invalid request rejects all: the valid ones end
    with an error starting with `NOT_RUN` that names the one rejected first."""

    requests: list[GenerateRequest]  # request ids unique among this client's live requests
    all_or_nothing: bool = False


@wire_message
class Abort:
    """Client -> frontend: stop these requests (finish reason "abort")."""

    request_ids: list[str]  # this client's; unknown or finished ids are ignored


@wire_message
class GetEngineInfo:
    """Client -> frontend: ask for `EngineInfo`."""


@wire_message
class EngineInfo:
    """Frontend -> client: what this engine serves and its limits."""

    model: str  # the name it serves the model under (served_model_names[0])
    max_model_len: int  # tokens: prompt plus output, at most
    num_kv_blocks: int  # KV-cache blocks on every rank
    block_size: int  # tokens per block
    vocab_size: int  # token ids are in [0, vocab_size)
    info: dict[str, Any] = field(default_factory=dict)  # e.g. max_message_bytes (this port's limit), eos_token_id
    served_model_names: list[str] = field(default_factory=list)  # names clients may ask for; `model` is the first


@wire_message
class Ping:
    """Client -> frontend: are you alive? Answered by `Pong` with the same nonce.

    Also the heartbeat between the frontend and the scheduler (each pings the other every second) and
    from the scheduler to idle workers; never answered."""

    nonce: int = 0  # any integer; the answer carries it back


@wire_message
class Pong:
    """Frontend -> client: the answer to `Ping`."""

    nonce: int = 0  # the ping's


@wire_struct
class TopLogprob:
    """One of the most likely tokens at a position."""

    token_id: int
    logprob: float  # natural log of its probability
    decoded_token: str  # tokenizer.decode([token_id])
    # The token's bytes when `decoded_token` does not hold them: a piece of a UTF-8 character, which decodes to
    # U+FFFD (byte-level tokenizers); None otherwise (the bytes are decoded_token's UTF-8).
    token_bytes: bytes | None = None


@wire_struct
class PositionLogprobs:
    """Logprobs at one position of an output (or of the prompt): the token there and the most likely ones."""

    token_id: int  # the sampled token (or the prompt token)
    logprob: float  # natural log of its probability
    rank: int  # 1 = the most likely token of the distribution
    decoded_token: str  # tokenizer.decode([token_id])
    top: list[TopLogprob] = field(default_factory=list)  # the top-N, most likely first
    token_bytes: bytes | None = None  # as TopLogprob.token_bytes


class LogprobColumns:
    """The logprobs of an output's positions, column by column: what `list[PositionLogprobs]` fields
    (`SampleOutput.logprobs`, `RequestOutput.logprobs`) carry on the wire, and what the frontend keeps per sample.

    The frontend appends a position per step and sends these columns; the client decodes them into the
    `PositionLogprobs` list its user reads. Building an object per top entry in the frontend, and encoding each
    as its own msgpack array, cost the frontend 2.4 ms per step at 256 rows with 5 top logprobs and 11 ms to send
    one finished request of 1,000 positions (benchmarks/throughput.py --filtered, where the frontend was the bound).

    Wire form (protocol version 2): ``[token_ids, logprobs, ranks, num_top, top_token_ids, top_logprobs, texts,
    raw]``: int32 / float32 bin columns of P positions and of their T = sum(num_top) top entries (most likely
    first, position by position), then the P decoded tokens followed by the T decoded top tokens, then a map from
    an index into those texts to the token's bytes, for the few tokens whose text does not hold them
    (`TopLogprob.token_bytes`). Logprobs travel as float32 (the engine computes them in float32).
    """

    __slots__ = ("token_ids", "logprobs", "ranks", "decoded", "num_top", "top_start", "top_token_ids",
                 "top_logprobs", "top_decoded", "raw", "top_raw")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.ranks: list[int] = []
        self.decoded: list[str] = []
        self.num_top: list[int] = []
        self.top_start: list[int] = []  # index of each position's first top entry
        self.top_token_ids: list[int] = []
        self.top_logprobs: list[float] = []
        self.top_decoded: list[str] = []
        self.raw: dict[int, bytes] = {}  # position index -> its token's bytes (see TopLogprob.token_bytes)
        self.top_raw: dict[int, bytes] = {}  # top entry index -> likewise

    def __len__(self) -> int:
        return len(self.token_ids)

    def append(self, token_id: int, logprob: float, rank: int, decoded: str, top_ids: list[int],
               top_logprobs: list[float], top_decoded: list[str], raw: dict[int, bytes] | None = None) -> None:
        """Add one position: its token, that token's logprob, rank and text, and its top entries. `raw`: the bytes
        of the tokens whose text does not hold them, by index (-1: the position's token, i >= 0: top entry i)."""
        if raw:
            for i, data in raw.items():
                if i < 0:
                    self.raw[len(self.token_ids)] = data
                else:
                    self.top_raw[len(self.top_token_ids) + i] = data
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.ranks.append(rank)
        self.decoded.append(decoded)
        self.num_top.append(len(top_ids))
        self.top_start.append(len(self.top_token_ids))
        self.top_token_ids += top_ids
        self.top_logprobs += top_logprobs
        self.top_decoded += top_decoded

    def since(self, start: int) -> LogprobColumns:
        """A copy of positions `start` .. the last (a streamed output's news)."""
        out = LogprobColumns()
        t = self.top_start[start] if start < len(self.top_start) else len(self.top_token_ids)
        out.token_ids, out.logprobs = self.token_ids[start:], self.logprobs[start:]
        out.ranks, out.decoded, out.num_top = self.ranks[start:], self.decoded[start:], self.num_top[start:]
        out.top_start = [x - t for x in self.top_start[start:]]
        out.top_token_ids, out.top_logprobs = self.top_token_ids[t:], self.top_logprobs[t:]
        out.top_decoded = self.top_decoded[t:]
        out.raw = {i - start: b for i, b in self.raw.items() if i >= start}
        out.top_raw = {i - t: b for i, b in self.top_raw.items() if i >= t}
        return out

    @classmethod
    def of(cls, positions: list[PositionLogprobs]) -> LogprobColumns:
        """The columns of a list of `PositionLogprobs`."""
        out = cls()
        for p in positions:
            raw = {i: e.token_bytes for i, e in enumerate(p.top) if e.token_bytes is not None}
            if p.token_bytes is not None:
                raw[-1] = p.token_bytes
            out.append(p.token_id, p.logprob, p.rank, p.decoded_token, [e.token_id for e in p.top],
                       [e.logprob for e in p.top], [e.decoded_token for e in p.top], raw)
        return out

    def positions(self) -> list[PositionLogprobs]:
        """The `PositionLogprobs` of every position, in order.

        Builds P + T objects (a 1,000-token output with 5 top logprobs: 6,000) with the garbage collector paused
        (`common.gc_pause`): 0.29 s instead of 0.87 s for throughput.py --filtered's 134,000 positions on the CI
        machine."""
        with collector_paused():
            return self._positions()

    def _positions(self) -> list[PositionLogprobs]:
        tops = [TopLogprob(*e) for e in zip(self.top_token_ids, self.top_logprobs, self.top_decoded)]
        for i, data in self.top_raw.items():
            tops[i].token_bytes = data
        out = [PositionLogprobs(token_id, logprob, rank, decoded, tops[t: t + k])
               for token_id, logprob, rank, decoded, t, k in zip(self.token_ids, self.logprobs, self.ranks,
                                                                 self.decoded, self.top_start, self.num_top)]
        for i, data in self.raw.items():
            out[i].token_bytes = data
        return out

    def to_wire(self) -> list[Any]:
        return [i32(self.token_ids).tobytes(), f32(self.logprobs).tobytes(), i32(self.ranks).tobytes(),
                i32(self.num_top).tobytes(), i32(self.top_token_ids).tobytes(), f32(self.top_logprobs).tobytes(),
                self.decoded + self.top_decoded,
                {**self.raw, **{len(self.token_ids) + i: b for i, b in self.top_raw.items()}}]

    @classmethod
    def from_wire(cls, raw: Any, where: str) -> LogprobColumns:
        """Raises `ProtocolError` naming `where` for anything but the wire form above."""
        if type(raw) is not list or len(raw) != 8:
            raise ProtocolError(f"{where}: expected logprob columns (an array of 8)")
        *columns, texts, token_bytes = raw
        if any(type(c) is not bytes or len(c) % 4 for c in columns):
            raise ProtocolError(f"{where}: expected int32 / float32 bytes in the logprob columns")
        token_ids, logprobs, ranks, num_top, top_ids, top_lps = (
            np.frombuffer(c, dtype="<f4" if i in (1, 5) else "<i4") for i, c in enumerate(columns))
        p, t = len(token_ids), len(top_ids)
        if len(logprobs) != p or len(ranks) != p or len(num_top) != p or len(top_lps) != t:
            raise ProtocolError(f"{where}: the logprob columns differ in length")
        if (num_top < 0).any() or int(num_top.sum()) != t:
            raise ProtocolError(f"{where}: num_top does not add up to the top entries")
        if type(texts) is not list or len(texts) != p + t or not all(type(x) is str for x in texts):
            raise ProtocolError(f"{where}: expected {p + t} decoded tokens")
        if type(token_bytes) is not dict or not all(type(i) is int and 0 <= i < p + t and type(b) is bytes
                                                    for i, b in token_bytes.items()):
            raise ProtocolError(f"{where}: expected a map from a decoded token's index to its bytes")
        out = cls()
        out.token_ids, out.logprobs, out.ranks = token_ids.tolist(), logprobs.tolist(), ranks.tolist()
        out.num_top = num_top.tolist()
        out.top_start = (np.cumsum(num_top) - num_top).tolist()
        out.top_token_ids, out.top_logprobs = top_ids.tolist(), top_lps.tolist()
        out.decoded, out.top_decoded = texts[:p], texts[p:]
        out.raw = {i: b for i, b in token_bytes.items() if i < p}
        out.top_raw = {i - p: b for i, b in token_bytes.items() if i >= p}
        return out


def _logprobs_to_wire(value: LogprobColumns | list[PositionLogprobs]) -> list[Any]:
    return (value if isinstance(value, LogprobColumns) else LogprobColumns.of(value)).to_wire()


def _logprobs_from_wire(raw: Any, where: str) -> list[PositionLogprobs]:
    return LogprobColumns.from_wire(raw, where).positions()


# An output's logprobs (`list[PositionLogprobs]`) travel as columns; prompt logprobs, sent once, stay structs.
wire_form(list[PositionLogprobs], _logprobs_to_wire, _logprobs_from_wire, also_encodes=(LogprobColumns,))


@wire_struct
class SampleOutput:
    """One sample of a request (vLLM's CompletionOutput): its news since the last output when streaming,
    else all of it."""

    index: int  # 0 .. n - 1
    text: str = ""  # new text since the last output (streaming), else all of it
    token_ids: list[int] = field(default_factory=list)  # output token ids, likewise
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"; None while it runs
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, else None
    logprobs: list[PositionLogprobs] | None = None  # one entry per token of `token_ids` (logprobs=N), else None
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs so far (logprobs=N), else None
    # finish reason "length" before its structured-output constraint was complete: the text does not match it
    structured_output_incomplete: bool = False


@wire_struct
class RequestOutput:
    """Frontend -> client: news of one request (a delta when streaming, else the whole output).

    The fields `text` .. `finish_reason`, `stop_reason`, `logprobs`, `cumulative_logprob`,
    `structured_output_incomplete` belong to sample `index` (always 0 for n = 1); the request's other samples with
    news are in `samples`. `outputs` gives them all as `SampleOutput`s in index order, the same for n = 1 and
    n > 1."""

    request_id: str  # the client's, from GenerateRequest
    text: str = ""  # new text since the last output of this request
    token_ids: list[int] = field(default_factory=list)  # new output token ids since the last output
    finished: bool = False  # the whole request (every sample) has finished
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: str | None = None  # why the request failed (finish_reason "error")
    num_prompt_tokens: int = 0  # tokens of the prompt as the engine ran it
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    # On finish: ttft_s, e2e_s, queue_s (arrival to first scheduled), all in seconds; num_preemptions.
    metrics: dict[str, int | float] = field(default_factory=dict)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended sample `index`, else None
    logprobs: list[PositionLogprobs] | None = None  # one entry per token of `token_ids` (logprobs=N), else None
    cumulative_logprob: float | None = None  # sum of sample `index`'s sampled logprobs so far (logprobs=N)
    # prompt_logprobs=N: one entry per prompt token, None for the first; in the first output (streaming) or the last
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    index: int = 0  # the sample the fields above describe
    samples: list[SampleOutput] = field(default_factory=list)  # the other samples with news, index order
    error_type: str | None = None  # with `error`: ERROR_INVALID_REQUEST, ERROR_ENGINE_DOWN or ERROR_OVERLOADED
    # sample `index` finished with "length" before its structured-output constraint was complete
    structured_output_incomplete: bool = False
    # A chat request when the engine has a reasoning parser: True when its prompt ends inside a reasoning block
    # (the template opened "<think>": the output starts in it), False when it ends just after one (the template
    # closed it, as Qwen3's does for enable_thinking=False: the output has none); None otherwise (the parser
    # reads the output alone). The same in every output of the request.
    prompt_reasoning: bool | None = None

    @property
    def outputs(self) -> list[SampleOutput]:
        """Every sample with news in this output (all n when not streaming), in index order."""
        first = SampleOutput(self.index, self.text, self.token_ids, self.finish_reason, self.stop_reason,
                             self.logprobs, self.cumulative_logprob, self.structured_output_incomplete)
        return sorted([first, *self.samples], key=lambda s: s.index)


# RequestOutput.error_type: whose fault an error is, so an HTTP server can answer 400 or 503.
ERROR_INVALID_REQUEST = "invalid_request"  # this request can never run (a field out of range, a prompt too long)
ERROR_ENGINE_DOWN = "engine_down"  # the engine is shutting down or a process died: the request may be retried
ERROR_OVERLOADED = "overloaded"  # refused at once by --max-waiting-requests: the same request may succeed later


@wire_message
class RequestOutputs:
    """Frontend -> client: outputs of one step for this client."""

    outputs: list[RequestOutput]  # at most one per request


@wire_message
class ErrorReply:
    """Frontend -> client: a message the frontend could not accept (e.g. malformed), or submitted requests it
    refused without running them because their ids are those of this client's live requests (which go on
    unaffected: an output with that id would have read as the live request's)."""

    error: str  # what was wrong, for a person to read
    refused_request_ids: list[str] = field(default_factory=list)  # the submitted requests refused, by id


# Limits of the client port. Every engine takes client messages of at least MIN_MAX_MESSAGE_BYTES (its
# own limit, `max_message_bytes`, is in EngineInfo.info; a peer sending more is disconnected unread),
# and request ids of at most MAX_REQUEST_ID_CHARS characters (a longer one gets an ErrorReply).
MIN_MAX_MESSAGE_BYTES = 64 << 10
MAX_REQUEST_ID_CHARS = 256


@wire_message
class Tokenize:
    """Client -> frontend: the token ids the engine would run for `request` (its prompt, prompt_token_ids or
    messages, add_generation_prompt and add_special_tokens; nothing is generated). Answered by `TokenizeResult`."""

    reply_id: int  # chosen by the client, copied into the answer
    request: GenerateRequest  # its sampling fields are ignored


@wire_message
class TokenizeResult:
    """Frontend -> client: the answer to `Tokenize`."""

    reply_id: int  # the question's
    token_ids: list[int] = field(default_factory=list)  # [prompt_len]
    error: str | None = None  # why the prompt could not be tokenized (then `token_ids` is empty)


@wire_message
class Detokenize:
    """Client -> frontend: the text of `token_ids`. Answered by `DetokenizeResult`."""

    reply_id: int  # chosen by the client, copied into the answer
    token_ids: list[int]
    skip_special_tokens: bool = False  # leave out the text of special tokens (<|im_end|>, ...)


@wire_message
class DetokenizeResult:
    """Frontend -> client: the answer to `Detokenize`."""

    reply_id: int  # the question's
    text: str = ""
    error: str | None = None  # e.g. a token id outside the vocabulary


@wire_message
class GetEngineStats:
    """Client -> frontend: ask for `EngineStats` (what a /metrics endpoint shows)."""

    reply_id: int  # chosen by the client, copied into the answer


@wire_struct
class Histogram:
    """Observations of one quantity, in buckets (Prometheus' cumulative buckets are sums of these)."""

    name: str  # e.g. "time_to_first_token_seconds"
    upper_bounds: list[float]  # ascending bucket bounds, in the quantity's unit (seconds or tokens)
    bucket_counts: list[int]  # observations v with upper_bounds[i-1] < v <= upper_bounds[i]; one more for > the last
    total: float  # sum of all observations


@wire_message
class EngineStats:
    """Frontend -> client: engine-wide statistics, totals since the engine started."""

    reply_id: int  # the question's
    scheduler: SchedulerStats | None = None  # the latest the scheduler sent (None before its first step)
    num_prompt_tokens: int = 0  # prompt tokens of requests whose prefill finished (first token sampled)
    num_generation_tokens: int = 0  # output tokens sampled
    num_finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests ended so far
    histograms: list[Histogram] = field(default_factory=list)  # per-request latencies and lengths (frontend/stats.py)
