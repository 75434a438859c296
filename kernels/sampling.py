"""Fused sampling: a split-vocabulary reduction over the logits picks each row's token.

For a row with temperature T > 0 the token is `argmax_i(logit_i / T + G_i)` with G_i standard
Gumbel noise, which samples softmax(logits / T) exactly (the Gumbel-max trick: Gumbel 1954;
Maddison, Tarlow & Minka 2014). The noise comes from Triton's counter-based Philox generator
keyed by a per-row seed and the global vocabulary index, so no noise tensor is ever written: the
logits are read once, in their own dtype. A row with T == 0 takes the plain argmax.

The argmax runs in two stages. One program per row would leave a large GPU mostly idle (a
256-row batch is 256 programs on 132 SMs, each looping over a 152k vocabulary), so stage one
splits each row into contiguous vocabulary chunks, grid `(rows, chunks)`, and every program
writes its chunk's best (score, index) to a `[rows, chunks]` scratch; stage two, one small
program per row, reduces over the chunks. Every entry's score depends only on its row and global
index, and ties go to the lowest index in both stages, so the token does not depend on the
chunking.

Under tensor parallelism each rank holds a slice of the vocabulary (`vocab_offset` is the global
index of its first column). The noise is keyed by the global index, so every rank scores its
entries exactly as one device holding the whole vocabulary would; `sample_candidates` returns
each row's best (score, global token id) of the slice, and the ranks keep the best of their
candidates (workers/sampler.py), which is the token a single device would pick.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# 8192 entries per chunk: 19 chunks for a 151936-entry vocabulary, 4864 programs for 256 rows.
DEFAULT_CHUNK_SIZE = 8192
_MAX_BLOCK_V = 2048  # entries each stage-one program loads per loop step
_MIN_BLOCK = 16


@triton.jit
def _chunk_argmax_kernel(
    logits_ptr,
    stride_row,
    temperatures_ptr,
    seeds_ptr,
    best_score_ptr,
    best_index_ptr,
    vocab_size,
    vocab_offset,
    num_chunks,
    CHUNK_V: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    seed = tl.load(seeds_ptr + row)
    greedy = temperature == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    noise_scale = tl.where(greedy, 0.0, 1.0)
    # Each lane keeps the best score it has seen and where; lanes are reduced once at the end.
    # An index of vocab_size means "no entry yet": -inf and NaN never replace it.
    best_score = tl.full([BLOCK_V], -float("inf"), tl.float32)
    best_index = tl.full([BLOCK_V], vocab_size, tl.int32)
    for start in range(0, CHUNK_V, BLOCK_V):
        cols = chunk * CHUNK_V + start + tl.arange(0, BLOCK_V)  # index within this slice
        mask = cols < vocab_size
        logits = tl.load(logits_ptr + row * stride_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
        u = tl.rand(seed, cols + vocab_offset)  # uniform in [0, 1); the global int32 index is the Philox counter
        gumbel = -tl.log(-tl.log(tl.maximum(u, 1e-20)))
        score = logits * inv_t + gumbel * noise_scale
        better = mask & (score > best_score)  # strictly greater: the first index wins a tie; NaN never wins
        best_index = tl.where(better, cols, best_index)
        best_score = tl.where(better, score, best_score)
    top = tl.max(best_score, axis=0)
    index = tl.min(tl.where(best_score == top, best_index, vocab_size), axis=0)  # lowest index among the best
    tl.store(best_score_ptr + row * num_chunks + chunk, top)
    tl.store(best_index_ptr + row * num_chunks + chunk, index)


@triton.jit
def _reduce_chunks_kernel(
    best_score_ptr,
    best_index_ptr,
    out_score_ptr,
    out_token_ptr,
    vocab_size,
    vocab_offset,
    num_chunks,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK_C)
    mask = chunks < num_chunks
    scores = tl.load(best_score_ptr + row * num_chunks + chunks, mask=mask, other=-float("inf"))
    indices = tl.load(best_index_ptr + row * num_chunks + chunks, mask=mask, other=vocab_size)
    top = tl.max(scores, axis=0)
    # Chunk c holds lower indices than chunk c + 1, so the lowest index among the best chunks is
    # the row's first best entry. A chunk with no finite winner holds index vocab_size.
    token = tl.min(tl.where(scores == top, indices, vocab_size), axis=0)
    tl.store(out_score_ptr + row, top)
    tl.store(out_token_ptr + row, tl.where(token < vocab_size, token, 0).to(tl.int64) + vocab_offset)


def sample_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Sample one token per row over the whole vocabulary: `[n]` int64 token ids.

    The token of `sample_candidates(logits, temperatures, seeds)`; see there for the arguments,
    errors and the all -inf / NaN row (token 0).
    """
    return sample_candidates(logits, temperatures, seeds, chunk_size=chunk_size)[1]


def sample_candidates(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    *,
    vocab_offset: int = 0,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's best entry of a vocabulary slice: its Gumbel-max score and global token id.

    Two kernel launches and two `[n, chunks]` scratch tensors (float32 scores, int32 indices);
    no host synchronisation, so the call can be captured in a CUDA graph.

    Args:
        logits: `[n, slice]` float (bf16, fp16 or fp32), last-dimension stride 1: columns
            `vocab_offset .. vocab_offset + slice - 1` of the vocabulary.
        temperatures: `[n]` float32; 0 selects the argmax (greedy), > 0 samples softmax(logits / T).
        seeds: `[n]` int64 Philox seeds; the same (seed, logits) always gives the same token.
        vocab_offset: global index of column 0 (0 unless the vocabulary is split over ranks).
        chunk_size: vocabulary entries per stage-one program, a power of two >= 16; None picks
            `min(DEFAULT_CHUNK_SIZE, slice rounded up to a power of two)`. It changes the speed,
            never the token (exposed for tests).

    Returns:
        `(scores, tokens)`: `[n]` float32 (logit / T + Gumbel noise; the logit for greedy rows)
        and `[n]` int64 global token ids. Over slices, the highest score wins and a tie goes to
        the lowest token id. A row whose logits are all -inf or NaN gets score -inf and token
        `vocab_offset`.

    Raises:
        ValueError: on mismatched shapes, a non-contiguous vocabulary dimension, a negative
            `vocab_offset`, or a chunk size that is not a power of two >= 16.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("logits must be [n, vocab] with a contiguous vocabulary dimension")
    n, vocab = logits.shape
    if temperatures.shape != (n,) or seeds.shape != (n,):
        raise ValueError(f"temperatures and seeds must be [{n}], got {tuple(temperatures.shape)}, {tuple(seeds.shape)}")
    if not 0 <= vocab_offset <= 2**31 - 1 - vocab:
        raise ValueError(f"vocab_offset must be >= 0 with offset + slice < 2**31, got {vocab_offset}")
    if chunk_size is None:
        chunk_size = min(DEFAULT_CHUNK_SIZE, max(_MIN_BLOCK, triton.next_power_of_2(vocab)))
    elif chunk_size < _MIN_BLOCK or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= {_MIN_BLOCK}, got {chunk_size}")
    scores = torch.empty(n, dtype=torch.float32, device=logits.device)
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    if not n:
        return scores, tokens
    block_v = min(_MAX_BLOCK_V, chunk_size)  # both powers of two: a chunk is whole blocks
    num_chunks = max(1, triton.cdiv(vocab, chunk_size))
    best_score = torch.empty(n, num_chunks, dtype=torch.float32, device=logits.device)
    best_index = torch.empty(n, num_chunks, dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(n, num_chunks)](
        logits, logits.stride(0), temperatures, seeds, best_score, best_index, vocab, vocab_offset, num_chunks,
        CHUNK_V=chunk_size, BLOCK_V=block_v, num_warps=4 if block_v >= 512 else 1,
    )
    _reduce_chunks_kernel[(n,)](
        best_score, best_index, scores, tokens, vocab, vocab_offset, num_chunks,
        BLOCK_C=max(_MIN_BLOCK, triton.next_power_of_2(num_chunks)), num_warps=1,
    )
    return scores, tokens
