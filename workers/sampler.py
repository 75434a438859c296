"""Token sampling: greedy rows by argmax, the others by the Gumbel-max trick.

Sampling from softmax(logits / T) by the Gumbel-max trick (Gumbel 1954; see Maddison, Tarlow &
Minka, "A* Sampling", 2014) in its exponential-race form: with E_i ~ Exp(1) independent, the
token `argmax_i logit_i / T - log E_i` is distributed as softmax(logits / T). It needs one random
draw per vocabulary entry and no sort, cumulative sum or normalisation, and runs batched on the
device.

Every row's noise is keyed by a per-row seed and the global vocabulary index. A request with a
seed draws with the seed (seed, position of the token being sampled), so its samples do not
depend on which other requests share the batch, nor on preemption and recomputation. Other rows
take seeds from a generator seeded by the engine's `seed`.

Tensor parallelism: the LM head leaves each rank with logits for its slice of the vocabulary. The
ranks draw the same per-row seeds (each rank's generator sees the same plans in the same order),
so each rank scores its entries exactly as one device holding the whole vocabulary would; every
rank takes the best (score, token) of its slice and one small all-gather of those candidates
gives every rank the token, the same token TP=1 picks. That replaces gathering the full logits
(39 MB a decode step of batch 256 at vocabulary 152k in bf16) to one rank and broadcasting its
tokens back.

On CUDA the whole batch is sampled by one fused Triton kernel (`gpu_kernels/sampling.py`, in-kernel
Philox noise: the logits are read once); on CPU by the torch code below (float64 scores, noise
from torch generators). The two draw different noise, so seeded samples are reproducible per
device type.

Rows whose requests use filters, penalties, logit bias or logprobs (`ProcessedRows`) come with their
logits already processed over the whole vocabulary (workers/logits_processing.py, temperature
applied); they are drawn from those by the same kernel with the same row seed, at temperature 1
(0 for greedy rows), on every rank alike. Rows that use only temperature never wait for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workers.host_buffers import to_device
from workers.parallel import all_gather, tp_size

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) over 64 bits


def seeded_generator_seed(seed: int, position: int) -> int:
    """The generator seed used for a seeded request's token at `position` (0..2**63-1)."""
    return ((seed * _SEED_MIX) ^ position) & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class ProcessedRows:
    """Rows of a step that are drawn from processed logits instead of the LM head's."""

    rows: torch.Tensor  # [R] int64 on the device: indices into the step's rows
    rows_host: np.ndarray  # [R] int64, the same on the host
    logits: torch.Tensor  # [R, vocab] float32: the whole vocabulary, processed, temperature applied
    temperatures: torch.Tensor  # [R] float32 on the device: 0 = argmax, 1 = sample softmax(logits)
    all_rows: bool  # every row of the step is one of them


class Sampler:
    """Samples one token per row from this rank's logits.

    `vocab_size` is the whole vocabulary and `vocab_start` the global index of this rank's first
    logit column (None and 0 at TP=1: the logits hold the whole vocabulary).
    """

    def __init__(self, device: torch.device, seed: int = 0, vocab_size: int | None = None,
                 vocab_start: int = 0) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.vocab_start = vocab_start
        self._generator = torch.Generator(device="cpu")
        self.fused = device.type == "cuda"  # the Triton kernel (else the torch code below)
        self._seeds = np.random.default_rng(seed)  # per-row noise seeds, the same on every rank

    @torch.no_grad()
    def compile_kernels(self, max_rows: int, vocab_slice: int, dtype: torch.dtype) -> None:
        """Compile the fused sampler for every batch of up to `max_rows` rows now (CUDA; nothing elsewhere):
        its chunk size varies with the batch, and a variant compiled mid-run held a decode step 0.4-0.7 s on
        the H200 (benchmarks/RESULTS.md, 2026-12-02 second session). Draws no seeds."""
        if self.fused:
            from gpu_kernels.sampling import compile_for_batches

            compile_for_batches(max_rows, vocab_slice, dtype, self.device, self.vocab_start)

    @torch.no_grad()
    def __call__(
        self,
        logits: torch.Tensor,
        temperatures: torch.Tensor,
        all_greedy: bool,
        seeded_rows: list[tuple[int, int, int]] | None = None,
        processed: ProcessedRows | None = None,
    ) -> torch.Tensor:
        """Sample one token per row.

        logits `[n, slice]` (any float dtype, computed in float32 or float64): this rank's columns
        of the vocabulary; temperatures `[n]` float32 on the same device (0 = greedy);
        `all_greedy` skips the random path when every row is greedy; `seeded_rows` lists
        (row, seed, position) for requests with a seed; `processed`: rows drawn from their processed
        logits instead (their entries of `logits` are not used). Returns token ids `[n]` int64 (global
        ids; the same on every rank). A row with no finite logit gets token 0.
        """
        seeds = None if all_greedy else self._draw(logits.shape[0], seeded_rows)
        tokens = None
        if processed is None or not processed.all_rows:
            tokens = self._sample_slice(logits, temperatures, all_greedy, seeds)
        if processed is None:
            return tokens
        row_seeds = seeds[processed.rows_host] if seeds is not None else np.zeros(len(processed.rows_host), np.int64)
        drawn = self._sample_whole(processed.logits, processed.temperatures, row_seeds)
        return drawn if tokens is None else tokens.index_copy(0, processed.rows, drawn)

    def draw_seeds(self, n: int, temperatures: np.ndarray, seeded_rows: list[tuple[int, int, int]] | None = None
                   ) -> np.ndarray | None:
        """The `[n]` int64 noise seeds a call with these rows' `temperatures` (`[n]` float32, on the host) would
        draw, drawn now (None when every row is greedy: nothing is drawn). For a caller that runs the fused kernel
        itself (a decode step's sampling graph, workers/cuda_graphs.py): the generator advances exactly as a
        call would, so a step samples the same tokens either way."""
        return None if not (temperatures > 0).any() else self._draw(n, seeded_rows)

    def _draw(self, n: int, seeded_rows: list[tuple[int, int, int]] | None) -> np.ndarray:
        seeds = self._seeds.integers(0, 2**62, size=n, dtype=np.int64)
        for row, seed, position in seeded_rows or ():
            seeds[row] = seeded_generator_seed(seed, position)
        return seeds

    def _sample_slice(self, logits: torch.Tensor, temperatures: torch.Tensor, all_greedy: bool,
                      seeds: np.ndarray | None) -> torch.Tensor:
        """Every row from this rank's slice; under TP the ranks then keep the best candidate."""
        if all_greedy:
            if tp_size() == 1:
                return logits.argmax(dim=-1)
            scores, tokens = logits.max(dim=-1)
            return best_across_ranks(scores, tokens + self.vocab_start)
        assert seeds is not None
        if self.fused:
            from gpu_kernels.sampling import sample_candidates

            # Through pinned memory: a copy from pageable memory may wait for the forward still running.
            seeds_dev = to_device(seeds, self.device)
            scores, tokens = sample_candidates(logits, temperatures, seeds_dev, vocab_offset=self.vocab_start)
        else:
            scores, tokens = self._cpu_candidates(logits, temperatures, seeds)
        return tokens if tp_size() == 1 else best_across_ranks(scores, tokens)

    def _sample_whole(self, logits: torch.Tensor, temperatures: torch.Tensor, seeds: np.ndarray) -> torch.Tensor:
        """Rows that hold the whole vocabulary (on every rank): the token, with no exchange between ranks."""
        if self.fused:
            from gpu_kernels.sampling import sample_candidates

            return sample_candidates(logits, temperatures, to_device(seeds, self.device))[1]
        return self._cpu_candidates(logits, temperatures, seeds, vocab_start=0, vocab_size=logits.shape[1])[1]

    def _cpu_candidates(self, logits: torch.Tensor, temperatures: torch.Tensor, seeds: np.ndarray,
                        vocab_start: int | None = None, vocab_size: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        n, width = logits.shape
        start = self.vocab_start if vocab_start is None else vocab_start
        vocab = (vocab_size or self.vocab_size) or width
        cols = slice(start, start + width)
        noise = torch.empty(n, width, dtype=torch.float64)
        draw = torch.empty(vocab, dtype=torch.float64)
        for row in range(n):  # one generator a row: its noise depends only on its seed and the global index
            self._generator.manual_seed(int(seeds[row]))
            noise[row] = draw.exponential_(generator=self._generator)[cols]
        # float64: logits / T cannot overflow for any float32 logit and temperature >= 1e-30, and
        # the scores of different ranks compare without a shared shift. A zero draw would give
        # +inf; clamping keeps it finite.
        greedy = temperatures <= 0
        safe_t = torch.where(greedy, torch.ones_like(temperatures), temperatures).double().unsqueeze(1)
        gumbel = -noise.clamp_min_(1e-300).log_()
        scores = logits.double() / safe_t + torch.where(greedy.unsqueeze(1), 0.0, gumbel)
        best, index = scores.nan_to_num_(nan=-float("inf")).max(dim=-1)  # NaN never wins; ties: first index
        return best, index + start


def best_across_ranks(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The token of the highest-scoring candidate over all ranks (ties: the lowest rank, which holds
    the lowest token ids). scores `[n]` float, tokens `[n]` int64 -> `[n]` int64 on every rank."""
    packed = torch.stack([scores.double(), tokens.double()])  # token ids < 2**53 are exact in float64
    gathered = all_gather(packed)  # [ranks, 2, n]
    best_rank = gathered[:, 0].argmax(dim=0, keepdim=True)
    return gathered[:, 1].gather(0, best_rank).squeeze(0).long()
