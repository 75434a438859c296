"""One request on a worker (`ReqState`), and what its sampling options ask of a step.

It sits below the persistent batch (workers/input_batch.py, which owns the states) and logits processing
(workers/logits_processing.py, which reads them): both import it, so neither imports the other for it. A
request's options are classified once, when its state is made: whether its rows take the processed path,
whether it keeps token counts for penalties, its dense parameters, and whether it has sparse ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from common.protocol import SamplingOptions
from common.sampling_params import GREEDY_TEMPERATURE

if TYPE_CHECKING:
    from workers.structured_output import RequestGrammar


def is_processed(options: SamplingOptions | None) -> bool:
    """Whether a request with these options takes the processed path (anything beyond temperature)."""
    if options is None:
        return False
    o = options
    return bool(o.grammar_id >= 0 or o.top_k > 0 or o.top_p < 1.0 or o.min_p > 0.0 or uses_penalties(o)
                or o.logit_bias or o.bad_words or o.min_tokens > 0 or o.logprobs >= 0)


def uses_penalties(options: SamplingOptions | None) -> bool:
    """Whether the request needs token counts (repetition, frequency or presence penalty)."""
    return options is not None and (options.repetition_penalty != 1.0 or options.frequency_penalty != 0.0
                                    or options.presence_penalty != 0.0)


def parameter_row(options: SamplingOptions) -> tuple[float, ...]:
    """A request's per-row parameters, computed once: (top_k, top_p, min_p, repetition, frequency, presence,
    logprobs); `build_processing` stacks these rows."""
    o = options
    return (o.top_k, o.top_p, o.min_p, o.repetition_penalty, o.frequency_penalty, o.presence_penalty, o.logprobs)


def has_sparse_parameters(options: SamplingOptions) -> bool:
    """Whether the request adds (row, token) entries: a logit bias, bad words or min_tokens."""
    return bool(options.logit_bias or options.bad_words or options.min_tokens > 0)


class ReqState:
    """One request on a worker."""

    __slots__ = ("seq_id", "row", "tokens", "num_tokens", "num_tokens_cpu", "num_computed", "num_blocks",
                 "temperature", "seed", "active", "num_prompt_tokens", "options", "processed", "penalized",
                 "prompt_logprobs_next", "parameter_row", "sparse", "grammar")

    def __init__(self, seq_id: int, temperature: float, seed: int | None,
                 options: SamplingOptions | None = None) -> None:
        self.seq_id = seq_id
        self.row: int | None = None
        self.tokens = np.zeros(0, dtype=np.int32)  # its row of InputBatch.token_ids, or a private copy while preempted
        self.num_tokens = 0  # prompt + sampled, including a token still being copied to the host
        self.num_tokens_cpu = 0  # leading entries of `tokens` that hold real ids
        self.num_computed = 0  # tokens whose KV is written (or being written by a launched step)
        self.num_blocks = 0
        self.temperature = 0.0 if temperature < GREEDY_TEMPERATURE else temperature
        self.seed = seed
        self.active = True  # False once finished: a late sampled token is dropped
        self.num_prompt_tokens = 0
        self.options = options
        self.processed = is_processed(options)  # its logits go through workers/logits_processing.py
        self.penalized = uses_penalties(options)  # it keeps token counts on the device
        self.parameter_row = parameter_row(options) if options is not None else ()
        self.sparse = options is not None and has_sparse_parameters(options)
        # The next prompt token whose logprob is reported (prompt_logprobs); each is reported once, also
        # when a preempted request computes its prompt again.
        self.prompt_logprobs_next = 1
        self.grammar: RequestGrammar | None = None  # its structured-output matcher, at its tokens on the host
