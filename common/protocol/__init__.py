"""Every message that crosses a socket, and the one codec that encodes them.

Processes and sockets (all ZeroMQ, ipc:// in a per-launch folder or tcp://)::

    client --DEALER/ROUTER--> frontend --PUSH/PULL--> scheduler --PUSH/PULL (one per rank)--> workers
    client <----------------- frontend <-------------- scheduler <------------- (rank 0 results)

Modules, one per socket (each message's docstring says who sends it to whom):

- `codec`: `encode`, `decode` and their checks, the int32/float32 array fields (`i32`, `f32`), the
  `wire_struct` / `wire_message` decorators and the registry `MESSAGE_TYPES`, `PROTOCOL_VERSION`,
  `ProtocolError`.
- `launcher`: start-up and shutdown (process ready or failed, the KV-cache hand-shake, `Shutdown`).
- `client`: client <-> frontend (`Submit`, `RequestOutputs`, `Abort`, engine info and stats, tokenize,
  detokenize, `Ping` / `Pong`; `Ping` is also the heartbeat of the internal sockets).
- `scheduler`: frontend <-> scheduler (`AddRequests`, `AbortSeqs`, `StepOutputs`).
- `worker`: scheduler <-> workers (`StepPlan`, `StepResult`, the grammar compilations).
- `profiling`: profiling sessions (client -> frontend -> scheduler -> workers).
- `types`: the structs that several sockets carry (`SamplingOptions`, `GrammarSpec`, `Logprobs`,
  `SchedulerStats`), so that no message module imports another.

Every public name is re-exported here: import from `common.protocol`. No other module defines a wire format.

Wire format: msgpack only (never pickle: a message from the network must not be able to run code). A
message is the array ``[PROTOCOL_VERSION, type_name, field_1, field_2, ...]`` with its fields in
declaration order; nested structs are plain arrays of their fields. Integer arrays (token ids, block ids,
sequence ids) travel as msgpack ``bin`` holding little-endian int32, which keeps a 256-request decode step
near 1 KiB and decodes without a Python loop.

Compatibility: a peer with another `PROTOCOL_VERSION` is refused. Within a version, new fields are only
ever appended, with defaults: a decoder fills missing trailing fields from their defaults (older sender)
and ignores extra trailing fields (newer sender). The encoder leaves off the trailing fields that equal
their defaults, so a field nobody sets costs no byte.

Deltas, not snapshots (the step plan, scheduler -> workers):

- A request's prompt token ids, sampling parameters and first block ids travel once, in `NewRequest`,
  in the first plan that schedules it.
- A request that continues costs only its sequence id (in `decode_seq_ids`, one token each) or its id
  and token count (in `prefill_seq_ids` / `prefill_num_tokens`, a later prefill chunk), plus `NewBlocks`
  only in the steps that allocate it a block.
- Finished (including aborted) and preempted ids are sent once. A preempted request keeps its tokens on
  the workers; when re-admitted, `ResumedRequest` brings only its new block ids.
- Sampled tokens never travel scheduler -> worker: each worker already holds them.

Rows of a step, in this order: `new_requests`, `resumed_requests`, prefill chunks, decodes. A row samples
one token exactly when its scheduled tokens reach the end of the tokens known for the request (prompt
plus tokens sampled so far); after the rows, each `ForkedRequest` samples one token (from its parent's
logits), in plan order. `StepResult.sampled_token_ids` holds those tokens in that order. Both sides apply
the same rule, so token ids need no request ids beside them.

Sampling parameters: a request's temperature and seed travel in `NewRequest`; everything else the
workers apply (filters, penalties, logit bias, bad words, min_tokens, logprobs) travels once, in
`NewRequest.options`, which is None (no byte) for a request that uses none of it. The workers keep what
penalties need (token counts) themselves: nothing is added to the steps that follow.

Samples (n > 1): the frontend gives a request of n samples the seq ids seq_id .. seq_id + n - 1 and sends
it once (`EngineRequest.n`); the scheduler computes the prompt once and forks samples 1..n-1 from it
(`StepPlan.forked_requests`). From then on every sample is a sequence of its own, in every message, and
each seq id gets exactly one `FinishedSeq`. The client sees one request: `RequestOutput.outputs` lists its
samples (`SampleOutput`), in index order, for any n, streamed (each sample's news) or not (all of it).

Structured outputs: the frontend sends a request's constraint (`GrammarSpec`) to the scheduler; the
scheduler numbers each distinct one and has every rank compile it (`CompileGrammars`, answered by
`GrammarCompiled`) before the request is first scheduled; `NewRequest` then names it by
`SamplingOptions.grammar_id`. The workers hold the matchers and advance them with the tokens they sample:
no mask crosses a socket. A constrained request that reaches max_tokens (or max_model_len) is named in the plan of
the step that samples its last token (`StepPlan.check_grammar_seq_ids`); rank 0 answers whether its grammar was
then incomplete (`StepResult.grammar_incomplete_seq_ids`), and the flag travels on to the client
(`FinishedSeq`, `SampleOutput.structured_output_incomplete`).

Logprobs (`Logprobs`, CSR over rows, only for the requests that asked; nothing, not even a field, for the
others): a sampled position costs 20 + 8 * N bytes (row index, position count, top count, logprob and
rank: 4 bytes each; each of the top N: int32 id + float32 logprob), both in `StepResult` and in
`StepOutputs`; a prompt position costs 8 + 8 * N, plus 12 per row per step. The frontend adds each token's
text and sends an output's logprobs to its client as columns (`LogprobColumns`: int32 / float32 bin and one
list of texts, since protocol version 2); the client decodes them into the `PositionLogprobs` list of
`RequestOutput.logprobs`. Prompt logprobs, sent once per request, travel as `PositionLogprobs` structs.

Errors: `decode` raises `ProtocolError` for anything malformed (not msgpack, wrong version, unknown type,
missing or mistyped field); receivers answer it or log it and keep serving.
"""

from common.protocol.client import (
    ERROR_ENGINE_DOWN,
    ERROR_INVALID_REQUEST,
    ERROR_OVERLOADED,
    MAX_REQUEST_ID_CHARS,
    MIN_MAX_MESSAGE_BYTES,
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
    Histogram,
    LogprobColumns,
    Ping,
    Pong,
    PositionLogprobs,
    RequestOutput,
    RequestOutputs,
    SampleOutput,
    Submit,
    Tokenize,
    TokenizeResult,
    TopLogprob,
)
from common.protocol.codec import (
    EMPTY_F32,
    EMPTY_I32,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Float32Array,
    Int32Array,
    ProtocolError,
    decode,
    encode,
    f32,
    i32,
    python_numbers,
    wire_error,
)
from common.protocol.launcher import (
    EngineReady,
    InitKVCache,
    KVCacheReady,
    ProcessFailed,
    ProcessReady,
    Shutdown,
    WorkerReady,
)
from common.protocol.profiling import ProfileStart, ProfileStatus, ProfileStop, StartProfile, StopProfile
from common.protocol.scheduler import AbortSeqs, AddRequests, EngineRequest, FinishedSeq, StepOutputs
from common.protocol.types import GrammarSpec, Logprobs, SamplingOptions, SchedulerStats
from common.protocol.worker import (
    CompileGrammars,
    ForkedRequest,
    GrammarCompiled,
    GrammarToCompile,
    NewBlocks,
    NewRequest,
    ResumedRequest,
    StepPlan,
    StepResult,
)

__all__ = [
    # codec
    "EMPTY_F32", "EMPTY_I32", "MESSAGE_TYPES", "PROTOCOL_VERSION", "Float32Array", "Int32Array", "ProtocolError",
    "decode", "encode", "f32", "i32", "python_numbers", "wire_error",
    # types
    "GrammarSpec", "Logprobs", "SamplingOptions", "SchedulerStats",
    # launcher
    "EngineReady", "InitKVCache", "KVCacheReady", "ProcessFailed", "ProcessReady", "Shutdown", "WorkerReady",
    # client
    "ERROR_ENGINE_DOWN", "ERROR_INVALID_REQUEST", "ERROR_OVERLOADED", "MAX_REQUEST_ID_CHARS", "MIN_MAX_MESSAGE_BYTES",
    "NOT_RUN", "Abort", "Detokenize", "DetokenizeResult", "EngineInfo", "EngineStats", "ErrorReply", "GenerateRequest",
    "GetEngineInfo", "GetEngineStats", "Histogram", "LogprobColumns", "Ping", "Pong", "PositionLogprobs",
    "RequestOutput", "RequestOutputs", "SampleOutput", "Submit", "Tokenize", "TokenizeResult", "TopLogprob",
    # scheduler
    "AbortSeqs", "AddRequests", "EngineRequest", "FinishedSeq", "StepOutputs",
    # worker
    "CompileGrammars", "ForkedRequest", "GrammarCompiled", "GrammarToCompile", "NewBlocks", "NewRequest",
    "ResumedRequest", "StepPlan", "StepResult",
    # profiling
    "ProfileStart", "ProfileStatus", "ProfileStop", "StartProfile", "StopProfile",
]
