"""A step's processed rows through the fused sampler: the worker's side of gpu_kernels/processed_sampling.py.

On a CUDA worker at TP 1 (and unless DELTASERVE_PROCESSED_SAMPLER=torch), a step with any processed row (filters,
penalties, logit bias, bans, a grammar or logprobs; `ProcessingInputs`) samples all of its rows, plain ones
included, in one call of `processed_sample`: 7 + NUM_PASSES launches whatever the mix, no sort of the vocabulary
and no float32 copy of the rows. It replaces the torch path of workers/logits_processing.py (a float32 copy of the
processed rows, the steps one by one, `torch.topk` or a full sort, then `token_logprobs`) with the same semantics
(gpu_kernels/processed_sampling.py states them; tests/kernels/test_processed_sampling.py checks both agree).

The penalty state becomes `PenaltyBits` (packed seen/generated bitsets and output counts, updated on the device
after each step), kept per batch row exactly as `PenaltyState` is: rebuilt from the host tokens when a penalized
request takes its row, copied to a forked sample's row. The row seeds are the plain sampler's (`Sampler.draw_seeds`),
so a plain row gets the token it gets without processed neighbours, and a seeded request the same token whatever
its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_kernels.processed_sampling import (
    MAX_TOP,
    ProcessedSample,
    ProcessedSamplingWorkspace,
    compile_for_batches,
    processed_sample,
)
from gpu_kernels.sampling_inputs import I_STATE_ROW, PenaltyBits, from_processing
from workers.deterministic import sampling_chunk_size
from workers.host_buffers import to_device
from workers.logits_processing import ProcessingInputs, worst_case_inputs


@dataclass
class FusedLogprobs:
    """The logprobs of the rows that asked, as device tensors (L rows, N = the widest top-N asked)."""

    token_logprobs: torch.Tensor  # [L] float32
    ranks: torch.Tensor  # [L] int64
    top_logprobs: torch.Tensor  # [L, N] float32, -inf past the kept set
    top_token_ids: torch.Tensor  # [L, N] int64


class FusedSampling:
    """The fused sampler of one worker: its device workspace and the penalty state of every batch row.

    `vocab_size` is the whole vocabulary (TP 1: the logits hold all of it); `max_num_seqs` the batch rows. The
    workspace's float32 scratch holds one row per batch row (rows with bias or bans), allocated here, so that
    `dummy_run` measures it before the KV cache is sized; `workspace_options` go to `ProcessedSamplingWorkspace`
    (tile size, passes, capacities: small ones make tests under the Triton interpreter fast).
    """

    def __init__(self, device: torch.device, max_num_seqs: int, vocab_size: int, **workspace_options: int) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.workspace = ProcessedSamplingWorkspace(device, vocab_size, max_scratch_rows=max_num_seqs,
                                                    **workspace_options)
        self.penalties = PenaltyBits(device, max_num_seqs, vocab_size)
        # None: the sampler sizes its vocabulary chunks by the batch; a fixed size in deterministic mode.
        self.chunk_size = sampling_chunk_size(vocab_size, self.workspace.tile_size, device)

    def sample(self, logits: torch.Tensor, temperatures: np.ndarray, seeds: np.ndarray | None,
               processing: ProcessingInputs, bitmask: torch.Tensor | None, last_sampled: torch.Tensor
               ) -> tuple[torch.Tensor, FusedLogprobs | None]:
        """Sample every row of a step.

        logits `[S, vocab]` (the LM head's dtype) for the step's S sampling rows; `temperatures` `[S]` float32 on
        the host (0 = greedy); `seeds` `[S]` int64 from `Sampler.draw_seeds` (None: every row is greedy);
        `processing` the processed rows (indices into the S rows); `bitmask` `[G, ceil(vocab / 32)]` int32 on the
        device, the grammar rows' masks in `processing.grammar_rows` order; `last_sampled` `[>= max_num_seqs]`
        int64, each batch row's latest token (bans conditional on it). Returns the tokens `[S]` int64 and the
        logprobs of `processing.logprob_rows` (None if no row asked); records the tokens in the penalty state.
        """
        n = logits.shape[0]
        params, sparse = from_processing(processing, temperatures, self.vocab_size, self.device)
        seeds_dev = to_device(seeds if seeds is not None else np.zeros(n, np.int64), self.device)
        num_top = int(processing.logprob_counts.max()) if len(processing.logprob_rows) else 0
        penalized = len(processing.penalty_rows) > 0
        out = processed_sample(logits, params, seeds_dev, workspace=self.workspace,
                               penalties=self.penalties if penalized else None, bitmask=bitmask,
                               sparse=sparse if sparse.num_scratch_rows else None, last_sampled=last_sampled,
                               num_top=min(num_top, MAX_TOP), chunk_size=self.chunk_size)
        if penalized:
            self.penalties.record(params.ints[:, I_STATE_ROW], out.tokens)
        return out.tokens, self._logprobs(out, processing)

    def _logprobs(self, out: ProcessedSample, processing: ProcessingInputs) -> FusedLogprobs | None:
        if not len(processing.logprob_rows):
            return None
        rows = processing.rows[processing.logprob_rows]  # sampling-row indices, ascending
        if len(rows) == out.tokens.shape[0]:
            return FusedLogprobs(out.logprobs, out.ranks, out.top_logprobs, out.top_ids)
        idx = to_device(rows.astype(np.int64), self.device)
        return FusedLogprobs(out.logprobs[idx], out.ranks[idx], out.top_logprobs[idx], out.top_ids[idx])

    def dummy_run(self, logits: torch.Tensor) -> None:
        """The costliest call for `logits` `[n, vocab]`: every row with a grammar allowing everything, the three
        penalties, top-p, min-p and 20 logprobs (`worst_case_inputs`), so the workspace's buffers for n rows and
        the penalty state exist before the KV cache is sized. Draws no seeds; leaves the penalty rows it used
        zeroed (a request that takes a row rebuilds it anyway)."""
        n = logits.shape[0]
        processing = worst_case_inputs(n)
        bitmask = torch.full((n, -(-self.vocab_size // 32)), -1, dtype=torch.int32, device=self.device)
        last = torch.zeros(max(n, self.penalties.max_num_seqs) + 1, dtype=torch.int64, device=self.device)
        self.sample(logits, np.full(n, 0.7, np.float32), np.zeros(n, np.int64), processing, bitmask, last)
        for t in self.penalties.tensors():
            t[:n] = 0

    def compile_kernels(self, max_rows: int, dtype: torch.dtype) -> None:
        """Compile the sampler for every batch of up to `max_rows` rows of `dtype` logits now (CUDA), so that no
        step compiles one mid-run."""
        compile_for_batches(max_rows, dtype, self.workspace, num_top=MAX_TOP)
