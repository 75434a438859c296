"""Frontend <-> scheduler (the scheduler's PULL socket `Endpoints.scheduler_in`, the frontend's PULL socket
`Endpoints.frontend_in`): tokenized requests and aborts one way, each step's sampled tokens and finished
requests the other."""

from __future__ import annotations

from dataclasses import field

from common.protocol.codec import Int32Array, empty_i32_field, wire_message, wire_struct
from common.protocol.types import GrammarSpec, Logprobs, SamplingOptions, SchedulerStats


@wire_struct
class EngineRequest:
    """A validated, tokenized request. `seq_id` is the engine-wide id chosen by the frontend."""

    seq_id: int  # sample 0's; the frontend counts them up from 0, n per request, never reusing one
    prompt_token_ids: Int32Array  # [prompt_len]
    temperature: float  # 0 = greedy
    max_tokens: int  # output tokens at most (the request also stops at max_model_len)
    seed: int | None  # None: the workers draw one from the engine's seeded generator
    stop_token_ids: list[int]  # sampled ids that finish the request (EOS unless ignore_eos, + user ids)
    arrival_time: float  # time.time() at the frontend, seconds
    options: SamplingOptions | None = None  # None: temperature sampling only
    n: int = 1  # samples; sample i has seq id seq_id + i (the scheduler forks them after the prompt)
    grammar: GrammarSpec | None = None  # structured outputs: the request waits until the workers compiled it


@wire_message
class AddRequests:
    """Frontend -> scheduler: new requests, queued in this order."""

    requests: list[EngineRequest]


@wire_message
class AbortSeqs:
    """Frontend -> scheduler: end these sequences (each sample of a request is one); each gets a
    `FinishedSeq` with reason "abort", unknown or finished ones none."""

    seq_ids: list[int]


@wire_struct
class FinishedSeq:
    """A sequence that ended in this step (each seq id ends exactly once)."""

    seq_id: int
    reason: str  # "stop", "length", "abort" or "error"
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    error: str | None = None  # set when reason == "error" (e.g. needs more KV blocks than exist)
    num_preemptions: int = 0  # times it was preempted and recomputed
    queue_time_s: float = -1.0  # seconds from arrival_time to its first scheduling; -1: never scheduled
    # reason "length", and its output is no complete sentence of its structured-output grammar (invalid JSON, say)
    structured_output_incomplete: bool = False


@wire_message
class StepOutputs:
    """Scheduler -> frontend: tokens sampled in one step, and requests that ended."""

    step_id: int
    seq_ids: Int32Array = empty_i32_field()  # [n] requests that received a token
    token_ids: Int32Array = empty_i32_field()  # [n] the token each received
    finished: list[FinishedSeq] = field(default_factory=list)
    num_cached_tokens: dict[int, int] = field(default_factory=dict)  # seq_id -> prefix hit, on first token
    logprobs: Logprobs | None = None  # rows: indices into seq_ids, for the requests that asked
    prompt_logprobs: Logprobs | None = None  # rows: seq ids
    stats: SchedulerStats | None = None  # the scheduler's state once this step's results are applied
