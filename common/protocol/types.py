"""Structs that more than one socket carries, so that no message module imports another: a request's
sampling options and structured-output constraint (frontend -> scheduler -> workers), a step's logprobs
(workers -> scheduler -> frontend) and the scheduler's state (scheduler -> frontend -> client)."""

from __future__ import annotations

from dataclasses import field

from common.protocol.codec import Float32Array, Int32Array, wire_struct


@wire_struct
class SamplingOptions:
    """What the workers do to a request's logits beyond temperature, and the logprobs it asks for.

    Travels in `EngineRequest` and, once, in `NewRequest`; None for a request that uses none of it, and
    defaults are left off the wire. Meanings and ranges are SamplingParams' (common/sampling_params.py).
    """

    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0  # a token generated c > 0 times loses this from its logit; 0: off
    frequency_penalty: float = 0.0  # ... and c times this; 0: off
    repetition_penalty: float = 1.0  # prompt and output tokens' logits: / it where > 0, * it where < 0; 1: off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    bad_words: list[list[int]] = field(default_factory=list)  # token-id sequences (each word, with and without a space)
    min_tokens: int = 0  # output tokens before `stop_token_ids` may be sampled
    stop_token_ids: list[int] = field(default_factory=list)  # masked until min_tokens outputs (set with min_tokens)
    logprobs: int = -1  # N >= 0: the sampled token's logprob and the top N; -1: none
    prompt_logprobs: int = -1  # N >= 0: each prompt token's logprob and the top N; -1: none
    # The structured-output grammar (`CompileGrammars`) whose token mask goes first; -1: none. Set by the
    # scheduler, which numbers the grammars (the frontend sends the constraint itself, `EngineRequest.grammar`).
    grammar_id: int = -1
    # With a grammar and a reasoning parser (chat requests): the grammar applies only after this token ("</think>")
    # has been sampled; -1: from the first output token.
    reasoning_end_token_id: int = -1
    # With `reasoning_end_token_id`: the first output token may also be this one ("<think>"), which opens the
    # reasoning (Qwen3 decides whether it thinks); any other first token starts the answer under the grammar at
    # once. -1: the output begins inside the reasoning.
    reasoning_start_token_id: int = -1


@wire_struct
class GrammarSpec:
    """A structured-output constraint (SamplingParams.structured_outputs) in the form the workers compile."""

    kind: str  # "json" (a JSON schema), "json_object" (any JSON object), "regex", "choice" or "grammar" (EBNF)
    spec: str  # the schema as JSON text, the regex, the choices as a JSON array, the EBNF; "" for json_object
    any_whitespace: bool = True  # json, json_object: any whitespace between elements (False: none)


@wire_struct
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


@wire_struct
class SchedulerStats:
    """The scheduler's state after a step (counts in requests, blocks or tokens; totals since start)."""

    num_running: int  # requests holding KV blocks
    num_waiting: int  # requests queued for admission, preempted ones included
    num_kv_blocks: int  # blocks on every rank
    num_free_blocks: int  # blocks no live request holds (cached prefixes among them can be reused or evicted)
    num_preemptions: int  # total
    prefix_cache_queries: int  # total prompt tokens looked up in the prefix cache at first admission
    prefix_cache_hits: int  # total of those tokens found in the cache
