"""Every message that crosses a socket, and the one codec that encodes them.

Processes and sockets (all ZeroMQ, ipc:// in a per-launch folder or tcp://)::

    client --DEALER/ROUTER--> frontend --PUSH/PULL--> scheduler --PUSH/PULL (one per rank)--> workers
    client <----------------- frontend <-------------- scheduler <------------- (rank 0 results)

A client is `EngineClient`, `LLM`, or an HTTP server process (`frontend/openai/`, through
`AsyncEngineClient`); all speak the same client messages.

Wire format: msgpack only (never pickle: a message from the network must not be able to run
code). A message is the array ``[PROTOCOL_VERSION, type_name, field_1, field_2, ...]`` with its
fields in declaration order; nested structs are plain arrays of their fields. Integer arrays
(token ids, block ids, sequence ids) travel as msgpack ``bin`` holding little-endian int32, which
keeps a 256-request decode step near 1 KiB and decodes without a Python loop.

Compatibility: a peer with another `PROTOCOL_VERSION` is refused. Within a version, new fields
are only ever appended, with defaults: a decoder fills missing trailing fields from their
defaults (older sender) and ignores extra trailing fields (newer sender). The encoder leaves off
the trailing fields that equal their defaults, so a field nobody sets costs no byte.

Deltas, not snapshots (the step plan, scheduler -> workers):
- A request's prompt token ids, sampling parameters and first block ids travel once, in
  `NewRequest`, in the first plan that schedules it.
- A request that continues costs only its sequence id (in `decode_seq_ids`, one token each) or
  its id and token count (in `prefill_seq_ids` / `prefill_num_tokens`, a later prefill chunk),
  plus `NewBlocks` only in the steps that allocate it a block.
- Finished (including aborted) and preempted ids are sent once. A preempted request keeps its
  tokens on the workers; when re-admitted, `ResumedRequest` brings only its new block ids.
- Sampled tokens never travel scheduler -> worker: each worker already holds them.

Rows of a step, in this order: `new_requests`, `resumed_requests`, prefill chunks, decodes. A row
samples one token exactly when its scheduled tokens reach the end of the tokens known for the
request (prompt plus tokens sampled so far); after the rows, each `ForkedRequest` samples one token
(from its parent's logits), in plan order. `StepResult.sampled_token_ids` holds those tokens in
that order. Both sides apply the same rule, so token ids need no request ids beside them.

Sampling parameters: a request's temperature and seed travel in `NewRequest` as before; everything
else the workers apply (filters, penalties, logit bias, bad words, min_tokens, logprobs) travels once,
in `NewRequest.options`, which is None (no byte) for a request that uses none of it. The workers keep
what penalties need (token counts) themselves: nothing is added to the steps that follow.

Samples (n > 1): the frontend gives a request of n samples the seq ids seq_id .. seq_id + n - 1 and
sends it once (`EngineRequest.n`); the scheduler computes the prompt once and forks samples 1..n-1
from it (`StepPlan.forked_requests`). From then on every sample is a sequence of its own, in every
message, and each seq id gets exactly one `FinishedSeq`. The client sees one request:
`RequestOutput.outputs` lists its samples (`SampleOutput`), in index order, for any n, streamed
(each sample's news) or not (all of it).

Structured outputs: the frontend sends a request's constraint (`GrammarSpec`) to the scheduler; the scheduler
numbers each distinct one and has every rank compile it (`CompileGrammars`, answered by `GrammarCompiled`)
before the request is first scheduled; `NewRequest` then names it by `SamplingOptions.grammar_id`. The
workers hold the matchers and advance them with the tokens they sample: no mask crosses a socket.

Logprobs (`Logprobs`, CSR over rows, only for the requests that asked; nothing, not even a field, for
the others): a sampled position costs 20 + 8 * N bytes (row index, position count, top count, logprob
and rank: 4 bytes each; each of the top N: int32 id + float32 logprob), both in `StepResult` and in
`StepOutputs`; a prompt position costs 8 + 8 * N, plus 12 per row per step. The frontend turns them
into `PositionLogprobs`, with each token's text, for the client.

Errors: `decode` raises `ProtocolError` for anything malformed (not msgpack, wrong version,
unknown type, missing or mistyped field); receivers answer it or log it and keep serving.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

import msgpack
import numpy as np

from common.errors import quote

PROTOCOL_VERSION = 1


class ProtocolError(ValueError):
    """A message could not be decoded (malformed, wrong version, unknown type, bad field)."""


class Int32Array:
    """Annotation marker: a 1-D int32 `numpy.ndarray` carried as msgpack bin (little-endian).

    Decoded arrays are read-only views of the received bytes; copy before writing into them.
    """


def i32(values: Any) -> np.ndarray:
    """A contiguous little-endian int32 array from a list, range or array.

    Raises `OverflowError` for a value outside the int32 range (never wraps silently).
    """
    if isinstance(values, np.ndarray) and values.dtype != np.int32 and values.size:
        if int(values.min()) < -(2**31) or int(values.max()) >= 2**31:
            raise OverflowError("a value does not fit in int32")
    return np.ascontiguousarray(values, dtype="<i4")


EMPTY_I32 = np.zeros(0, dtype="<i4")
EMPTY_I32.setflags(write=False)


def _empty_i32() -> Any:
    return field(default_factory=lambda: EMPTY_I32)


class Float32Array:
    """Annotation marker: a 1-D float32 `numpy.ndarray` carried as msgpack bin (little-endian IEEE 754).

    Decoded arrays are read-only views of the received bytes; copy before writing into them.
    """


def f32(values: Any) -> np.ndarray:
    """A contiguous little-endian float32 array from a list or array (values round to float32)."""
    return np.ascontiguousarray(values, dtype="<f4")


EMPTY_F32 = np.zeros(0, dtype="<f4")
EMPTY_F32.setflags(write=False)


def _empty_f32() -> Any:
    return field(default_factory=lambda: EMPTY_F32)


_MESSAGES: dict[str, type] = {}
_HINTS: dict[type, list[tuple[str, Any]]] = {}
_NO_DEFAULT = object()
# Per struct, each field's default (or _NO_DEFAULT): trailing fields at their defaults are left off the wire.
_DEFAULTS: dict[type, list[Any]] = {}


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _NO_DEFAULT


def _struct(cls: type) -> type:
    """Make `cls` a dataclass whose fields travel as a positional array."""
    cls = dataclass(cls)
    hints = typing.get_type_hints(cls, globalns=globals())
    _HINTS[cls] = [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]
    _DEFAULTS[cls] = [_field_default(f) for f in dataclasses.fields(cls)]
    return cls


def _message(cls: type) -> type:
    """A top-level message: a struct that carries its type name on the wire."""
    cls = _struct(cls)
    _MESSAGES[cls.__name__] = cls
    return cls


# ============================================================================ launcher / start-up
@_message
class ProcessReady:
    """Any process -> launcher: started and ready. `info` is free-form, for logs."""

    name: str  # e.g. "frontend", "scheduler", "worker-tp0"
    info: dict[str, Any] = field(default_factory=dict)


@_message
class ProcessFailed:
    """Any process -> launcher (and scheduler -> frontend): a fatal error, sent before exiting."""

    name: str
    error: str  # human-readable cause, shown to the user


@_message
class WorkerReady:
    """Worker -> scheduler: model loaded; how many KV-cache blocks this rank can hold."""

    rank: int
    max_num_kv_blocks: int  # blocks that fit in this rank's KV-cache budget
    kv_bytes_per_block: int  # bytes of one block (K and V, all layers) on this rank
    device: str  # e.g. "cuda:0 (NVIDIA H200)" or "cpu"


@_message
class InitKVCache:
    """Scheduler -> workers: allocate this many KV-cache blocks (the minimum over ranks)."""

    num_kv_blocks: int


@_message
class KVCacheReady:
    """Worker -> scheduler: cache allocated (and CUDA graphs captured)."""

    rank: int
    info: dict[str, Any] = field(default_factory=dict)


@_message
class EngineReady:
    """Scheduler -> frontend: the engine is serving; its capacity."""

    num_kv_blocks: int
    block_size: int  # tokens per block
    info: dict[str, Any] = field(default_factory=dict)


@_message
class Shutdown:
    """Launcher -> any process, or scheduler -> workers: exit cleanly."""

    reason: str = ""


# ============================================================================ client <-> frontend
@_struct
class GenerateRequest:
    """One prompt. Exactly one of `prompt`, `prompt_token_ids`, `messages` is set."""

    request_id: str  # chosen by the client, unique among its live requests
    prompt: str | None = None  # encoded as tokenizer(prompt) would
    prompt_token_ids: list[int] | None = None
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


NOT_RUN = "not run: "  # the error of a valid request of an all-or-nothing submission that another one sank


@_message
class Submit:
    """Client -> frontend: new requests. With `all_or_nothing`, one invalid request rejects all: the valid ones end
    with an error starting with `NOT_RUN` that names the one rejected first."""

    requests: list[GenerateRequest]
    all_or_nothing: bool = False


@_message
class Abort:
    """Client -> frontend: stop these requests (finish reason "abort")."""

    request_ids: list[str]


@_message
class GetEngineInfo:
    """Client -> frontend: ask for `EngineInfo`."""


@_message
class EngineInfo:
    """Frontend -> client: what this engine serves and its limits."""

    model: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    info: dict[str, Any] = field(default_factory=dict)
    served_model_names: list[str] = field(default_factory=list)  # names clients may ask for; `model` is the first


@_message
class Ping:
    """Client -> frontend: are you alive? Answered by `Pong` with the same nonce.

    Also the heartbeat between the frontend and the scheduler (each pings the other every second) and
    from the scheduler to idle workers; never answered."""

    nonce: int = 0


@_message
class Pong:
    nonce: int = 0


@_struct
class TopLogprob:
    """One of the most likely tokens at a position."""

    token_id: int
    logprob: float  # natural log of its probability
    decoded_token: str  # tokenizer.decode([token_id])


@_struct
class PositionLogprobs:
    """Logprobs at one position of an output (or of the prompt): the token there and the most likely ones."""

    token_id: int  # the sampled token (or the prompt token)
    logprob: float
    rank: int  # 1 = the most likely token of the distribution
    decoded_token: str  # tokenizer.decode([token_id])
    top: list[TopLogprob] = field(default_factory=list)  # the top-N, most likely first


@_struct
class SampleOutput:
    """One sample of a request (vLLM's CompletionOutput): its news since the last output when streaming,
    else all of it."""

    index: int  # 0 .. n - 1
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"; None while it runs
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, else None
    logprobs: list[PositionLogprobs] | None = None  # one entry per token of `token_ids` (logprobs=N), else None
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs so far (logprobs=N), else None


@_struct
class RequestOutput:
    """Frontend -> client: news of one request (a delta when streaming, else the whole output).

    The fields `text` .. `finish_reason`, `stop_reason`, `logprobs`, `cumulative_logprob` belong to sample
    `index` (always 0 for n = 1); the request's other samples with news are in `samples`. `outputs` gives
    them all as `SampleOutput`s in index order, the same for n = 1 and n > 1."""

    request_id: str
    text: str = ""  # new text since the last output of this request
    token_ids: list[int] = field(default_factory=list)  # new output token ids since the last output
    finished: bool = False  # the whole request (every sample) has finished
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: str | None = None  # why the request failed (finish_reason "error")
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    # On finish: ttft_s, e2e_s, queue_s (arrival to first scheduled), all in seconds; num_preemptions.
    metrics: dict[str, int | float] = field(default_factory=dict)
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    # prompt_logprobs=N: one entry per prompt token, None for the first; in the first output (streaming) or the last
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    index: int = 0  # the sample the fields above describe
    samples: list[SampleOutput] = field(default_factory=list)  # the other samples with news, index order
    error_type: str | None = None  # with `error`: ERROR_INVALID_REQUEST, ERROR_ENGINE_DOWN or ERROR_OVERLOADED

    @property
    def outputs(self) -> list[SampleOutput]:
        """Every sample with news in this output (all n when not streaming), in index order."""
        first = SampleOutput(self.index, self.text, self.token_ids, self.finish_reason, self.stop_reason,
                             self.logprobs, self.cumulative_logprob)
        return sorted([first, *self.samples], key=lambda s: s.index)


# RequestOutput.error_type: whose fault an error is, so an HTTP server can answer 400 or 503.
ERROR_INVALID_REQUEST = "invalid_request"  # this request can never run (a field out of range, a prompt too long)
ERROR_ENGINE_DOWN = "engine_down"  # the engine is shutting down or a process died: the request may be retried
ERROR_OVERLOADED = "overloaded"  # refused at once by --max-waiting-requests: the same request may succeed later


@_message
class RequestOutputs:
    """Frontend -> client: outputs of one step for this client."""

    outputs: list[RequestOutput]


@_message
class ErrorReply:
    """Frontend -> client: a message the frontend could not accept (e.g. malformed), or submitted requests it
    refused without running them because their ids are those of this client's live requests (which go on
    unaffected: an output with that id would have read as the live request's)."""

    error: str
    refused_request_ids: list[str] = field(default_factory=list)  # the submitted requests refused, by id


# Limits of the client port. Every engine takes client messages of at least MIN_MAX_MESSAGE_BYTES (its
# own limit, `max_message_bytes`, is in EngineInfo.info; a peer sending more is disconnected unread),
# and request ids of at most MAX_REQUEST_ID_CHARS characters (a longer one gets an ErrorReply).
MIN_MAX_MESSAGE_BYTES = 64 << 10
MAX_REQUEST_ID_CHARS = 256


# ============================================================================ frontend -> scheduler -> workers
@_struct
class SamplingOptions:
    """What the workers do to a request's logits beyond temperature, and the logprobs it asks for.

    Travels in `EngineRequest` and, once, in `NewRequest`; None for a request that uses none of it, and
    defaults are left off the wire. Meanings and ranges are SamplingParams' (common/sampling_params.py).
    """

    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    bad_words: list[list[int]] = field(default_factory=list)  # token-id sequences (each word, with and without a space)
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)  # masked until min_tokens outputs (set with min_tokens)
    logprobs: int = -1  # N >= 0: the sampled token's logprob and the top N; -1: none
    prompt_logprobs: int = -1  # N >= 0: each prompt token's logprob and the top N; -1: none
    # The structured-output grammar (`CompileGrammars`) whose token mask goes first; -1: none. Set by the
    # scheduler, which numbers the grammars (the frontend sends the constraint itself, `EngineRequest.grammar`).
    grammar_id: int = -1


@_struct
class GrammarSpec:
    """A structured-output constraint (SamplingParams.structured_outputs) in the form the workers compile."""

    kind: str  # "json" (a JSON schema), "json_object" (any JSON object), "regex", "choice" or "grammar" (EBNF)
    spec: str  # the schema as JSON text, the regex, the choices as a JSON array, the EBNF; "" for json_object
    any_whitespace: bool = True  # json, json_object: any whitespace between elements (False: none)


@_struct
class Logprobs:
    """Logprobs of some rows of a step, positions grouped by row (CSR layout).

    Row i has `counts[i]` consecutive positions; each position has its token's logprob and rank, and
    `num_top[i]` top entries, most likely first. In `StepResult.logprobs` a row is an index into the
    step's sampling rows, in `StepOutputs.logprobs` an index into `seq_ids` (one position each: the
    sampled token); in `prompt_logprobs` it is a seq id, and its positions continue that request's
    prompt logprobs from prompt token 1 on, in order.
    """

    rows: Int32Array  # [r]
    counts: Int32Array  # [r] positions of each row
    num_top: Int32Array  # [r] top entries per position of each row
    token_logprobs: Float32Array  # [P = sum(counts)] logprob of the sampled (or prompt) token
    ranks: Int32Array  # [P] its rank, 1 = the most likely
    top_token_ids: Int32Array  # [sum(counts * num_top)]
    top_logprobs: Float32Array  # [sum(counts * num_top)]


@_message
class Tokenize:
    """Client -> frontend: the token ids the engine would run for `request` (its prompt, prompt_token_ids or
    messages, add_generation_prompt and add_special_tokens; nothing is generated). Answered by `TokenizeResult`."""

    reply_id: int  # chosen by the client, copied into the answer
    request: GenerateRequest


@_message
class TokenizeResult:
    reply_id: int
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # why the prompt could not be tokenized (then `token_ids` is empty)


@_message
class Detokenize:
    """Client -> frontend: the text of `token_ids`. Answered by `DetokenizeResult`."""

    reply_id: int
    token_ids: list[int]
    skip_special_tokens: bool = False


@_message
class DetokenizeResult:
    reply_id: int
    text: str = ""
    error: str | None = None  # e.g. a token id outside the vocabulary


@_message
class GetEngineStats:
    """Client -> frontend: ask for `EngineStats` (what a /metrics endpoint shows)."""

    reply_id: int


@_struct
class Histogram:
    """Observations of one quantity, in buckets (Prometheus' cumulative buckets are sums of these)."""

    name: str  # e.g. "time_to_first_token_seconds"
    upper_bounds: list[float]  # ascending bucket bounds, in the quantity's unit (seconds or tokens)
    bucket_counts: list[int]  # observations v with upper_bounds[i-1] < v <= upper_bounds[i]; one more for > the last
    total: float  # sum of all observations


@_struct
class SchedulerStats:
    """The scheduler's state after a step (counts in requests, blocks or tokens; totals since start)."""

    num_running: int  # requests holding KV blocks
    num_waiting: int  # requests queued for admission, preempted ones included
    num_kv_blocks: int
    num_free_blocks: int  # blocks no live request holds (cached prefixes among them can be reused or evicted)
    num_preemptions: int  # total
    prefix_cache_queries: int  # total prompt tokens looked up in the prefix cache at first admission
    prefix_cache_hits: int  # total of those tokens found in the cache


@_message
class EngineStats:
    """Frontend -> client: engine-wide statistics, totals since the engine started."""

    reply_id: int
    scheduler: SchedulerStats | None = None  # the latest the scheduler sent (None before its first step)
    num_prompt_tokens: int = 0  # prompt tokens of requests whose prefill finished (first token sampled)
    num_generation_tokens: int = 0  # output tokens sampled
    num_finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests ended so far
    histograms: list[Histogram] = field(default_factory=list)  # per-request latencies and lengths (frontend/stats.py)


# ============================================================================ frontend -> scheduler
@_struct
class EngineRequest:
    """A validated, tokenized request. `seq_id` is the engine-wide id chosen by the frontend."""

    seq_id: int
    prompt_token_ids: Int32Array
    temperature: float  # 0 = greedy
    max_tokens: int
    seed: int | None
    stop_token_ids: list[int]  # sampled ids that finish the request (EOS unless ignore_eos, + user ids)
    arrival_time: float  # time.time() at the frontend, seconds
    options: SamplingOptions | None = None  # None: temperature sampling only
    n: int = 1  # samples; sample i has seq id seq_id + i (the scheduler forks them after the prompt)
    grammar: GrammarSpec | None = None  # structured outputs: the request waits until the workers compiled it


@_message
class AddRequests:
    requests: list[EngineRequest]


@_message
class AbortSeqs:
    seq_ids: list[int]


# ============================================================================ scheduler -> frontend
@_struct
class FinishedSeq:
    seq_id: int
    reason: str  # "stop", "length", "abort" or "error"
    num_cached_tokens: int = 0
    error: str | None = None  # set when reason == "error" (e.g. needs more KV blocks than exist)
    num_preemptions: int = 0  # times it was preempted and recomputed
    queue_time_s: float = -1.0  # seconds from arrival_time to its first scheduling; -1: never scheduled


@_message
class StepOutputs:
    """Scheduler -> frontend: tokens sampled in one step, and requests that ended."""

    step_id: int
    seq_ids: Int32Array = _empty_i32()  # [n] requests that received a token
    token_ids: Int32Array = _empty_i32()  # [n] the token each received
    finished: list[FinishedSeq] = field(default_factory=list)
    num_cached_tokens: dict[int, int] = field(default_factory=dict)  # seq_id -> prefix hit, on first token
    logprobs: Logprobs | None = None  # rows: indices into seq_ids, for the requests that asked
    prompt_logprobs: Logprobs | None = None  # rows: seq ids
    stats: SchedulerStats | None = None  # the scheduler's state once this step's results are applied


# ============================================================================ scheduler -> workers
@_struct
class NewRequest:
    """A request the workers have not seen: everything they need, sent once."""

    seq_id: int
    prompt_token_ids: Int32Array
    temperature: float
    seed: int | None
    block_ids: Int32Array  # its whole block table so far
    num_computed_tokens: int  # prefix-cache hit: tokens whose KV is already in those blocks
    num_scheduled_tokens: int  # tokens to compute this step, from position num_computed_tokens
    options: SamplingOptions | None = None


@_struct
class ForkedRequest:
    """Sample i > 0 of an n > 1 request, forked from its parent (sample 0) in the step that computes the
    end of the parent's prompt. It shares the parent's full prompt blocks and owns a copy of the last,
    partial one (copy-on-write): the workers copy that block's KV after the step's forward and sample the
    fork's first token from the parent's logits with the fork's seed. Its options are the parent's."""

    seq_id: int
    parent_seq_id: int
    seed: int | None
    block_ids: Int32Array  # its whole block table


@_struct
class ResumedRequest:
    """A preempted request admitted again; the workers still hold its tokens."""

    seq_id: int
    block_ids: Int32Array  # its new whole block table
    num_computed_tokens: int
    num_scheduled_tokens: int


@_struct
class NewBlocks:
    seq_id: int
    block_ids: Int32Array  # appended to the request's block table


@_message
class StepPlan:
    """Scheduler -> every worker rank: what to run in step `step_id` (deltas only)."""

    step_id: int
    new_requests: list[NewRequest] = field(default_factory=list)
    resumed_requests: list[ResumedRequest] = field(default_factory=list)
    prefill_seq_ids: Int32Array = _empty_i32()  # [p] running requests with a later prefill chunk
    prefill_num_tokens: Int32Array = _empty_i32()  # [p] tokens of that chunk
    decode_seq_ids: Int32Array = _empty_i32()  # [d] running requests computing one token
    new_blocks: list[NewBlocks] = field(default_factory=list)  # applied before the step runs
    finished_seq_ids: Int32Array = _empty_i32()  # finished or aborted: forget them (applied first)
    preempted_seq_ids: Int32Array = _empty_i32()  # free their blocks, keep their tokens (applied first)
    forked_requests: list[ForkedRequest] = field(default_factory=list)  # applied after the rows; sample after them


@_struct
class GrammarToCompile:
    grammar_id: int  # chosen by the scheduler, never reused
    grammar: GrammarSpec


@_message
class CompileGrammars:
    """Scheduler -> every worker rank: compile these grammars off the step loop (each rank answers each with a
    `GrammarCompiled`), and drop the compiled grammars `forget_ids`, which no live request uses any more.

    The scheduler keeps the book (scheduler_proc/grammar_cache.py): a grammar is compiled once while it stays
    cached, a request that uses it waits until every rank has compiled it, and its `SamplingOptions.grammar_id`
    names it in `NewRequest`, so the constraint itself crosses to the workers once per grammar, not per request."""

    grammars: list[GrammarToCompile] = field(default_factory=list)
    forget_ids: Int32Array = _empty_i32()


# ============================================================================ workers -> scheduler
@_message
class GrammarCompiled:
    """Worker rank -> scheduler: grammar `grammar_id` is compiled and matchers for it can be made at once (`error`
    None), or it cannot be compiled (`error` says why, naming the field; its requests fail with it)."""

    rank: int
    grammar_id: int
    error: str | None = None
    compile_s: float = 0.0  # seconds the compilation took on this rank


@_message
class StepResult:
    """Worker rank 0 -> scheduler: the tokens sampled in a step, in row order."""

    step_id: int
    sampled_token_ids: Int32Array = _empty_i32()
    timings: dict[str, Any] = field(default_factory=dict)  # *_ms in milliseconds, and counts; for the step log
    logprobs: Logprobs | None = None  # rows: indices into sampled_token_ids, for the requests that asked
    prompt_logprobs: Logprobs | None = None  # rows: seq ids
    # seq id -> why the request must fail: its grammar refused the token sampled for it, which happens only when
    # another parameter (bad_words, min_tokens) banned every token the grammar allowed
    failed: dict[int, str] = field(default_factory=dict)


# ============================================================================ profiling sessions
# The scheduler numbers the steps, so it decides when a session starts and stops (common/profiling.py):
# client --StartProfile/StopProfile--> frontend --(same)--> scheduler --ProfileStart/ProfileStop--> workers,
# frontend; the scheduler answers each request with a ProfileStatus, which the frontend passes on.
@_message
class StartProfile:
    """Client -> frontend -> scheduler: trace every process from the next step on, for at most `num_steps`
    steps (0: as many as the engine's `--profile-steps` window holds)."""

    num_steps: int = 0


@_message
class StopProfile:
    """Client -> frontend -> scheduler: end the trace after the last step planned so far."""


@_message
class ProfileStart:
    """Scheduler -> every worker rank and the frontend: start tracing now; `first_step` is the next step
    to run. The trace ends after `last_step`, or at the `ProfileStop` that says an earlier step."""

    session: int  # 1, 2, ... in this engine's life
    first_step: int
    last_step: int
    folder: str  # where every process writes its files for this session


@_message
class ProfileStop:
    """Scheduler -> workers (right after the plan of `last_step`) and frontend (after that step's
    outputs): stop tracing once step `last_step` is done and write the files."""

    session: int
    last_step: int  # first_step - 1 when the session ended before any step ran


@_message
class ProfileStatus:
    """Scheduler -> frontend -> client: the answer to one `StartProfile` or `StopProfile`. A stop is
    answered once the session's timeline is merged, with its summary."""

    session: int = 0
    first_step: int = -1
    last_step: int = -1
    folder: str = ""
    summary: str = ""  # the summary table of a stopped session (also in <folder>/summary.txt)
    error: str | None = None  # why the request was refused; nothing changed


# ============================================================================ codec
def _at_default(value: Any, default: Any) -> bool:
    if default is _NO_DEFAULT:
        return False
    if isinstance(value, np.ndarray):
        return isinstance(default, np.ndarray) and value.size == 0 and default.size == 0
    if isinstance(default, (list, dict)):
        return type(value) is type(default) and not value and not default
    return type(value) is type(default) and value == default


def _struct_to_wire(value: Any) -> list[Any]:
    """A struct's fields in order, without the trailing ones that equal their defaults (the decoder puts
    those back): a field nobody sets costs no byte."""
    cls = type(value)
    values = [getattr(value, name) for name, _ in _HINTS[cls]]
    defaults = _DEFAULTS[cls]
    end = len(values)
    while end and _at_default(values[end - 1], defaults[end - 1]):
        end -= 1
    return [v if type(v) in _SCALARS else _array_to_wire(v, hint) if isinstance(v, np.ndarray) else _to_wire(v)
            for v, (_, hint) in zip(values[:end], _HINTS[cls])]


def _array_to_wire(value: np.ndarray, hint: Any) -> bytes:
    return (f32(value) if hint is Float32Array else i32(value)).tobytes()


def _to_wire(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return i32(value).tobytes()
    if type(value) in _HINTS:  # a registered struct (only those can travel)
        return _struct_to_wire(value)
    if isinstance(value, (list, tuple)):
        if all(type(v) in _SCALARS for v in value):  # e.g. 100k prompt token ids: no per-item call
            return value
        return [_to_wire(v) for v in value]
    return value


_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})


def encode(msg: Any) -> bytes:
    """Encode a message (an instance of a class registered here) to msgpack bytes."""
    cls = type(msg)
    if _MESSAGES.get(cls.__name__) is not cls:
        raise TypeError(f"{cls.__name__} is not a protocol message")
    return msgpack.packb([PROTOCOL_VERSION, cls.__name__, *_to_wire(msg)], use_bin_type=True)


def python_numbers(value: Any) -> Any:
    """`value` with numpy numbers made Python ones (what msgpack and JSON carry): a numpy scalar, a
    numpy array (as a list), or a list or tuple holding numpy scalars (same container type); anything
    else unchanged."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)) and any(isinstance(v, np.generic) for v in value):
        return type(value)(v.item() if isinstance(v, np.generic) else v for v in value)
    return value


def wire_error(value: Any, where: str = "") -> str | None:
    """Why `value` (a message, a struct or a field value) cannot be encoded, naming the first bad
    part by its path under `where` (e.g. "prompt_token_ids[1]"); None if it can.

    msgpack takes integers in [-2**63, 2**64), text that encodes as UTF-8 (no lone surrogates),
    floats, bytes, None, lists and maps of those, and the int32 arrays of this module.
    """
    if value is None or isinstance(value, (bool, float, bytes, np.ndarray)):
        return None
    if isinstance(value, int):
        if -(2**63) <= value < 2**64:
            return None
        return f"{where} is {value}, which does not fit in 64 bits"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (f"{where} is not valid Unicode text: it holds the lone surrogate {value[exc.start]!r} at index "
                    f"{exc.start}, which has no UTF-8 encoding")
        return None
    if type(value) in _HINTS:
        for name, _ in _HINTS[type(value)]:
            why = wire_error(getattr(value, name), f"{where}.{name}" if where else name)
            if why is not None:
                return why
        return None
    if isinstance(value, (list, tuple)):
        return next((why for i, v in enumerate(value) if (why := wire_error(v, f"{where}[{i}]")) is not None), None)
    if isinstance(value, dict):
        for k, v in value.items():
            why = wire_error(k, f"{where} key {k!r}") or wire_error(v, f"{where}[{k!r}]")
            if why is not None:
                return why
        return None
    return f"{where} is a {type(value).__name__}, which cannot be sent (use int, float, str, list or dict)"


def decode(data: bytes) -> Any:
    """Decode bytes into a message. Raises `ProtocolError` for anything malformed."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types for garbage
        raise ProtocolError(f"not a msgpack message ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, list) or len(obj) < 2:
        raise ProtocolError("a message must be an array [version, type, fields...]")
    version, name, *values = obj
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {quote(version)} (this peer speaks {PROTOCOL_VERSION})")
    cls = _MESSAGES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {quote(name)}")
    return _build(cls, values, name)


def _build(cls: type, values: Any, where: str) -> Any:
    """The struct `cls` from its wire fields. The checks compiled for `cls` run first; only a message they
    refuse is checked again field by field, which names the field that is wrong (a path string per field
    made for every message cost more than the rest of decoding: 27 us per token of logprobs)."""
    try:
        return _fast_builder(cls)(values)
    except _Mismatch:
        return _checked_build(cls, values, where)


class _Mismatch(Exception):
    """A compiled check refused a value; the slow checks say why, with the field's path."""


_FAST: dict[Any, Callable[[Any], Any]] = {}


def _fast_builder(cls: type) -> Callable[[Any], Any]:
    build = _FAST.get(cls)
    if build is None:
        names = [name for name, _ in _HINTS[cls]]
        checks = [_fast_check(hint) for _, hint in _HINTS[cls]]

        def build(values: Any) -> Any:
            if type(values) is not list:
                raise _Mismatch
            try:
                return cls(**{name: check(v) for name, check, v in zip(names, checks, values)})
            except TypeError:
                raise _Mismatch from None

        _FAST[cls] = build
    return build


def _fast_check(hint: Any) -> Callable[[Any], Any]:
    """A check of one field against `hint` that converts as `_check` does and raises `_Mismatch` where
    `_check` raises `ProtocolError`."""
    if hint in _FAST and hint not in _HINTS:
        return _FAST[hint]
    origin = typing.get_origin(hint)
    check: Callable[[Any], Any]
    if hint is Any:
        def check(v: Any) -> Any:
            return v
    elif hint is Int32Array or hint is Float32Array:
        dtype = "<i4" if hint is Int32Array else "<f4"

        def check(v: Any) -> Any:
            if type(v) is not bytes or len(v) % 4:
                raise _Mismatch
            return np.frombuffer(v, dtype=dtype)
    elif origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        optional = type(None) in args
        options = [_fast_check(a) for a in args if a is not type(None)]

        def check(v: Any) -> Any:
            if v is None and optional:
                return None
            for option in options[:-1]:
                try:
                    return option(v)
                except _Mismatch:
                    pass
            return options[-1](v)
    elif origin is list:
        (item,) = typing.get_args(hint)
        item_check = _fast_check(item)
        plain = item if item in (int, str) else None

        def check(v: Any) -> Any:
            if type(v) is not list:
                raise _Mismatch
            if plain is not None and all(type(x) is plain for x in v):
                return v
            return [item_check(x) for x in v]
    elif origin is dict:
        key_check, value_check = (_fast_check(a) for a in typing.get_args(hint))

        def check(v: Any) -> Any:
            if type(v) is not dict:
                raise _Mismatch
            return {key_check(k): value_check(x) for k, x in v.items()}
    elif hint in _HINTS:
        def check(v: Any) -> Any:
            return _fast_builder(hint)(v)
    elif hint is float:
        def check(v: Any) -> Any:
            if type(v) is float:
                return v
            if type(v) is not int:  # bool is not int here, as in _check
                raise _Mismatch
            return float(v)
    elif hint is int:
        def check(v: Any) -> Any:
            if type(v) is not int:
                raise _Mismatch
            return v
    elif hint in (str, bool, bytes):
        def check(v: Any) -> Any:
            if not isinstance(v, hint):
                raise _Mismatch
            return v
    else:
        def check(v: Any) -> Any:
            return v
    if hint not in _HINTS:
        try:
            _FAST[hint] = check
        except TypeError:  # an unhashable hint: not cached
            pass
    return check


def _checked_build(cls: type, values: Any, where: str) -> Any:
    if not isinstance(values, list):
        raise ProtocolError(f"{where}: expected an array of fields")
    spec = _HINTS[cls]
    kwargs = {}
    for (name, hint), value in zip(spec, values):  # extra trailing values: a newer peer's fields
        kwargs[name] = _check(hint, value, f"{where}.{name}")
    try:
        return cls(**kwargs)  # missing trailing fields take their defaults
    except TypeError as exc:
        raise ProtocolError(f"{where}: {exc}") from None


def _check(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if hint is Int32Array:
        if not isinstance(value, bytes) or len(value) % 4:
            raise ProtocolError(f"{where}: expected int32 bytes")
        return np.frombuffer(value, dtype="<i4")
    if hint is Float32Array:
        if not isinstance(value, bytes) or len(value) % 4:
            raise ProtocolError(f"{where}: expected float32 bytes")
        return np.frombuffer(value, dtype="<f4")
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for option in inner[:-1]:  # the first alternative that fits, in the order written
            try:
                return _check(option, value, where)
            except ProtocolError:
                pass
        return _check(inner[-1], value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected an array, got {type(value).__name__}")
        (item,) = typing.get_args(hint)
        if item in (int, str) and all(type(v) is item for v in value):  # the common case, checked in one pass
            return value
        return [_check(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
        key_hint, value_hint = typing.get_args(hint)
        return {_check(key_hint, k, f"{where} key"): _check(value_hint, v, f"{where}[{quote(k)}]")
                for k, v in value.items()}
    if hint in _HINTS:
        return _build(hint, value, where)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{where}: expected a number, got {type(value).__name__}")
        return float(value)
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ProtocolError(f"{where}: expected an integer, got {type(value).__name__}")
    if hint in (str, bool, bytes) and not isinstance(value, hint):
        raise ProtocolError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
    return value


MESSAGE_TYPES = _MESSAGES  # name -> class, for tests and tools
