"""Scheduler <-> workers (one scheduler PUSH socket per rank, `Endpoints.plans`; the scheduler's PULL socket
`Endpoints.worker_out`): the step plan, in deltas, and rank 0's sampled tokens; the grammars to compile.

Sequence ids are the frontend's (`EngineRequest.seq_id`, + i for sample i), block ids index the KV cache
(0 .. num_kv_blocks - 1), token counts are in tokens. How a plan's rows are ordered and which rows sample
is in the docstring of `common.protocol`.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from common.protocol.codec import Int32Array, empty_i32_field, wire_message, wire_struct
from common.protocol.types import GrammarSpec, Logprobs, SamplingOptions


@wire_struct
class NewRequest:
    """A request the workers have not seen: everything they need, sent once."""

    seq_id: int
    prompt_token_ids: Int32Array  # [prompt_len]
    temperature: float  # 0 = greedy
    seed: int | None  # None: the workers draw one from the engine's seeded generator
    block_ids: Int32Array  # its whole block table so far
    num_computed_tokens: int  # prefix-cache hit: tokens whose KV is already in those blocks
    num_scheduled_tokens: int  # tokens to compute this step, from position num_computed_tokens
    options: SamplingOptions | None = None  # None: temperature sampling only


@wire_struct
class ForkedRequest:
    """Sample i > 0 of an n > 1 request, forked from its parent (sample 0) in the step that computes the
    end of the parent's prompt. It shares the parent's full prompt blocks and owns a copy of the last,
    partial one (copy-on-write): the workers copy that block's KV after the step's forward and sample the
    fork's first token from the parent's logits with the fork's seed. Its options are the parent's."""

    seq_id: int  # parent_seq_id + i
    parent_seq_id: int  # sample 0, in this plan's rows
    seed: int | None  # sample_seed(parent's seed, i) (common/sampling_params.py); None as for NewRequest
    block_ids: Int32Array  # its whole block table


@wire_struct
class ResumedRequest:
    """A preempted request admitted again; the workers still hold its tokens."""

    seq_id: int
    block_ids: Int32Array  # its new whole block table
    num_computed_tokens: int  # prefix-cache hit: tokens whose KV is already in those blocks
    num_scheduled_tokens: int  # tokens to compute this step, from position num_computed_tokens


@wire_struct
class NewBlocks:
    """Blocks allocated in this step to a request the workers hold."""

    seq_id: int
    block_ids: Int32Array  # appended to the request's block table


@wire_message
class StepPlan:
    """Scheduler -> every worker rank: what to run in step `step_id` (deltas only)."""

    step_id: int  # 0, 1, 2, ... for plans that run rows; -1 for one that only finishes or preempts
    new_requests: list[NewRequest] = field(default_factory=list)
    resumed_requests: list[ResumedRequest] = field(default_factory=list)
    prefill_seq_ids: Int32Array = empty_i32_field()  # [p] running requests with a later prefill chunk
    prefill_num_tokens: Int32Array = empty_i32_field()  # [p] tokens of that chunk
    decode_seq_ids: Int32Array = empty_i32_field()  # [d] running requests computing one token
    new_blocks: list[NewBlocks] = field(default_factory=list)  # applied before the step runs
    finished_seq_ids: Int32Array = empty_i32_field()  # finished or aborted: forget them (applied first)
    preempted_seq_ids: Int32Array = empty_i32_field()  # free their blocks, keep their tokens (applied first)
    forked_requests: list[ForkedRequest] = field(default_factory=list)  # applied after the rows; sample after them
    # [c] constrained requests (structured outputs) whose row samples their last token in this step (max_tokens or
    # max_model_len reached): rank 0 names in `StepResult.grammar_incomplete_seq_ids` those whose output then is
    # no complete sentence of their grammar
    check_grammar_seq_ids: Int32Array = empty_i32_field()


@wire_message
class StepResult:
    """Worker rank 0 -> scheduler: the tokens sampled in a step, in row order."""

    step_id: int  # the plan's
    sampled_token_ids: Int32Array = empty_i32_field()  # [rows that sample + forks], in plan order
    timings: dict[str, Any] = field(default_factory=dict)  # *_ms in milliseconds, and counts; for the step log
    logprobs: Logprobs | None = None  # rows: indices into sampled_token_ids, for the requests that asked
    prompt_logprobs: Logprobs | None = None  # rows: seq ids
    # seq id -> why the request must fail: its grammar refused the token sampled for it, which happens only when
    # another parameter (bad_words, min_tokens) banned every token the grammar allowed
    failed: dict[int, str] = field(default_factory=dict)
    # [i] of the plan's `check_grammar_seq_ids`, those whose output after this step's token is no complete sentence
    # of their grammar (an unclosed JSON object, a choice half written)
    grammar_incomplete_seq_ids: Int32Array = empty_i32_field()


@wire_struct
class GrammarToCompile:
    """One grammar of `CompileGrammars`, with the number requests name it by."""

    grammar_id: int  # chosen by the scheduler, never reused
    grammar: GrammarSpec


@wire_message
class CompileGrammars:
    """Scheduler -> every worker rank: compile these grammars off the step loop (each rank answers each with a
    `GrammarCompiled`), and drop the compiled grammars `forget_ids`, which no live request uses any more.

    The scheduler keeps the book (scheduler_proc/grammar_cache.py): a grammar is compiled once while it stays
    cached, a request that uses it waits until every rank has compiled it, and its `SamplingOptions.grammar_id`
    names it in `NewRequest`, so the constraint itself crosses to the workers once per grammar, not per request."""

    grammars: list[GrammarToCompile] = field(default_factory=list)
    forget_ids: Int32Array = empty_i32_field()  # [f] grammar ids


@wire_message
class GrammarCompiled:
    """Worker rank -> scheduler: grammar `grammar_id` is compiled and matchers for it can be made at once (`error`
    None), or it cannot be compiled (`error` says why, naming the field; its requests fail with it)."""

    rank: int
    grammar_id: int
    error: str | None = None  # None: compiled
    compile_s: float = 0.0  # seconds the compilation took on this rank
