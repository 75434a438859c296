"""A request as the scheduler sees it: its tokens, its blocks and how far it has been computed."""

from __future__ import annotations

import dataclasses
from enum import Enum

import numpy as np

from common.protocol import EngineRequest, SamplingOptions
from common.sampling_params import sample_seed


class SeqStatus(Enum):
    WAITING = 0  # not admitted yet, or preempted and waiting to be admitted again
    RUNNING = 1  # holds blocks and is scheduled every step until it finishes
    FINISHED = 2
    WAITING_FOR_GRAMMAR = 3  # its structured-output grammar is compiling on the workers: not queued yet


class Sequence:
    """One request in the scheduler process.

    Token accounting (all counts in tokens):
    - `token_ids`: the prompt plus every sampled token received from the workers.
    - `num_pending_tokens`: tokens sampled in steps still in flight, not received yet. The
      workers already hold them, so the next step can feed them as inputs.
    - `num_tokens` = len(token_ids) + num_pending_tokens: the tokens the workers know of.
    - `num_computed_tokens`: tokens whose KV is written by steps already scheduled.
    A step schedules `num_tokens - num_computed_tokens` tokens (or fewer, a prefill chunk); the row
    samples a new token exactly when it reaches `num_tokens`.

    Samples (n > 1): the request's Sequence is sample 0 and holds `num_unforked` = n - 1 samples to
    fork (seq ids `seq_id + 1 ..`) once its prompt is computed; each fork is a Sequence of its own.
    """

    __slots__ = (
        "seq_id", "token_ids", "num_prompt_tokens", "temperature", "max_tokens", "seed", "stop_token_ids",
        "arrival_time", "status", "block_table", "block_hashes", "num_hashed_blocks", "num_computed_tokens",
        "num_pending_tokens", "num_cached_tokens", "known_to_workers", "num_preemptions", "first_token_sent",
        "options", "min_tokens", "num_unforked", "next_fork_index", "use_prefix_cache", "queue_time_s",
    )

    def __init__(self, req: EngineRequest) -> None:
        self.seq_id = req.seq_id
        self.token_ids: list[int] = req.prompt_token_ids.tolist()
        self.num_prompt_tokens = len(self.token_ids)
        self.temperature = req.temperature
        self.max_tokens = req.max_tokens
        self.seed = req.seed
        self.stop_token_ids = frozenset(req.stop_token_ids)
        self.arrival_time = req.arrival_time
        self.options: SamplingOptions | None = req.options
        self.min_tokens = req.options.min_tokens if req.options is not None else 0  # stop ids end it only after
        self.num_unforked = req.n - 1
        self.next_fork_index = 1
        # Prompt logprobs need every prompt position computed: such requests never take cached blocks.
        self.use_prefix_cache = req.options is None or req.options.prompt_logprobs < 0
        self.status = SeqStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hash of each leading full block of token_ids
        self.num_hashed_blocks = 0  # leading blocks of block_table already offered to the prefix cache
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 before admission
        self.known_to_workers = False  # workers hold its state (from its first plan until finished)
        self.num_preemptions = 0
        self.first_token_sent = False
        self.queue_time_s = -1.0  # seconds from arrival_time (the frontend's clock) to first admission; -1 before

    def make_fork(self) -> Sequence:
        """The next sample of this request: its prompt, parameters and seed stream (`sample_seed`), with no
        blocks and nothing computed. It reports no prompt logprobs (sample 0 does)."""
        index = self.next_fork_index
        self.next_fork_index += 1
        self.num_unforked -= 1
        options = self.options
        if options is not None and options.prompt_logprobs >= 0:
            options = dataclasses.replace(options, prompt_logprobs=-1)
        req = EngineRequest(self.seq_id + index, _NO_TOKENS, self.temperature, self.max_tokens,
                            sample_seed(self.seed, index), [], self.arrival_time, options)
        fork = Sequence(req)
        fork.token_ids = self.token_ids[: self.num_prompt_tokens]
        fork.num_prompt_tokens = self.num_prompt_tokens
        fork.stop_token_ids = self.stop_token_ids
        return fork

    @property
    def grammar_id(self) -> int:
        """Its structured-output grammar (GrammarCache), or -1."""
        return self.options.grammar_id if self.options is not None else -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled so far, in flight included."""
        return self.num_tokens - self.num_prompt_tokens

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, pending={self.num_pending_tokens}, "
                f"blocks={self.block_table})")


_NO_TOKENS = np.zeros(0, dtype=np.int32)
