"""Fused sampling: a split-vocabulary reduction over the logits picks each row's token.

For a row with temperature T > 0 the token is `argmax_i(logit_i / T + G_i)` with G_i standard
Gumbel noise, which samples softmax(logits / T) exactly (the Gumbel-max trick: Gumbel 1954;
Maddison, Tarlow & Minka 2014). The noise comes from Triton's counter-based Philox4x32-10
generator (Salmon et al., SC 2011) keyed by a per-row seed, so no noise tensor is ever written:
the logits are read once, in their own dtype. One Philox evaluation yields four 32-bit words, and
all four are used: entry g of the global vocabulary takes word g % 4 of the evaluation at counter
g // 4. That mapping depends only on (seed, g), never on the chunk or block sizes, the batch, or a
rank's `vocab_offset`. A row with T == 0 takes the plain argmax by a scalar branch that evaluates
no Philox at all, so in a mixed batch only the sampled rows pay for noise.

Cost (reasoning; the GPU numbers come from `python benchmarks/kernel_bench.py sampling`): the noise is
integer work, not memory traffic. Philox4x32-10 is 10 rounds of two 32x32->64-bit multiplies and
a few xors on four words; spent on one entry (the old `tl.rand` per entry, one word used) it
dominated the kernel (0.19 ms at batch 256 on an H200, against 0.04 ms to read the bf16 logits);
shared by four entries it costs a quarter of that per entry, which leaves the two logarithms of
the Gumbel transform as the next largest term.

The argmax runs in two stages. One program per row would leave a large GPU mostly idle (a
256-row batch is 256 programs on 132 SMs, each looping over a 152k vocabulary), so stage one
splits each row into contiguous vocabulary chunks, grid `(rows, chunks)`, and every program
writes its chunk's best (score, index) to a `[rows, chunks]` scratch; stage two, one small
program per row, reduces over the chunks. The chunk size follows the batch (`choose_chunk_size`):
8192 entries at batch 256 (4864 programs, enough to fill every SM several times, while each
program's final cross-warp reduction is paid once per 8192 entries), down to 512 at batch 1 (297
programs, where 8192 would leave 19 programs on 132 SMs each scanning 8192 entries in turn).
Every entry's score depends only on its row and global index, and ties go to the lowest index in
both stages, so the token does not depend on the chunking.

Under tensor parallelism each rank holds a slice of the vocabulary (`vocab_offset` is the global
index of its first column). The noise is keyed by the global index, so every rank scores its
entries exactly as one device holding the whole vocabulary would (a slice need not start at a
multiple of 4: its first chunk starts up to 3 masked entries early, so every tile still covers
whole 4-entry groups); `sample_candidates` returns
each row's best (score, global token id) of the slice, and the ranks keep the best of their
candidates (workers/sampler.py), which is the token a single device would pick.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Entries per stage-one program: the largest power of two in [_MIN_CHUNK_SIZE, DEFAULT_CHUNK_SIZE] that still
# gives the batch _MIN_PROGRAMS_PER_SM programs per SM. At batch 256 and vocabulary 151936 that is 8192
# (19 chunks, 4864 programs); at batch 1 it is 512 (297 programs), so a single row still spreads over
# every SM instead of 19 of them each looping over 8192 entries.
DEFAULT_CHUNK_SIZE = 8192
_MIN_CHUNK_SIZE = 512
_MIN_PROGRAMS_PER_SM = 2
_MAX_BLOCK_V = 2048  # entries each stage-one program loads per loop step
_MIN_BLOCK = 16
_GROUP = 4  # Philox4x32 gives four 32-bit words per counter: entries 4c .. 4c + 3 share counter c


@triton.jit
def _chunk_best(
    logits_row_ptr,
    seed,
    inv_t,
    vocab_size,
    vocab_offset,
    chunk_start,
    CHUNK_V: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SHIFT: tl.constexpr,
    NOISE: tl.constexpr,
):
    """Best (score, local index) of the entries chunk_start .. chunk_start + CHUNK_V - 1 of one row.

    The entries are scanned as a [BLOCK_V / 4, 4] tile whose row q holds global indices 4c .. 4c + 3
    for one Philox counter c: `chunk_start + vocab_offset` is a multiple of 4 (the caller shifts the
    chunks by SHIFT = vocab_offset % 4), so entry g always takes word g % 4 of counter g // 4.
    """
    quads = tl.arange(0, BLOCK_V // 4)
    words = tl.arange(0, 4)
    # Each lane keeps the best score it has seen and where; lanes are reduced once at the end.
    # An index of vocab_size means "no entry yet": -inf and NaN never replace it.
    best_score = tl.full([BLOCK_V // 4, 4], -float("inf"), tl.float32)
    best_index = tl.full([BLOCK_V // 4, 4], vocab_size, tl.int32)
    for start in range(0, CHUNK_V, BLOCK_V):
        base = chunk_start + start  # local index of the tile's first entry; base + vocab_offset = 0 mod 4
        cols = base + 4 * quads[:, None] + words[None, :]
        mask = cols < vocab_size
        if SHIFT > 0:
            mask = mask & (cols >= 0)  # the first chunk starts SHIFT entries before the slice
        logits = tl.load(logits_row_ptr + cols, mask=mask, other=-float("inf")).to(tl.float32)
        score = logits * inv_t
        if NOISE:
            counters = (base + vocab_offset) // 4 + quads  # int32: global index < 2**31
            r0, r1, r2, r3 = tl.randint4x(seed, counters)  # Philox4x32-10, all four words used
            bits = tl.where(words[None, :] == 0, r0[:, None],
                            tl.where(words[None, :] == 1, r1[:, None],
                                     tl.where(words[None, :] == 2, r2[:, None], r3[:, None])))
            u = tl.uint_to_uniform_float(bits)  # [0, 1), exactly 0 with probability 2**-31
            # Standard Gumbel noise; u = 0 is clamped so the noise stays finite (-3.83 at the floor).
            score = score - tl.log(-tl.log(tl.maximum(u, 1e-20)))
        better = mask & (score > best_score)  # strictly greater: the first index wins a tie; NaN never wins
        best_index = tl.where(better, cols, best_index)
        best_score = tl.where(better, score, best_score)
    top = tl.max(tl.max(best_score, axis=1), axis=0)
    index = tl.min(tl.min(tl.where(best_score == top, best_index, vocab_size), axis=1), axis=0)  # lowest of the best
    return top, index


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
    SHIFT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    logits_row_ptr = logits_ptr + row * stride_row
    chunk_start = chunk * CHUNK_V - SHIFT
    # A greedy row never evaluates Philox: in a mixed batch only the sampled rows pay for the noise.
    if temperature == 0.0:
        top, index = _chunk_best(logits_row_ptr, 0, 1.0, vocab_size, vocab_offset, chunk_start,
                                 CHUNK_V, BLOCK_V, SHIFT, False)
    else:
        seed = tl.load(seeds_ptr + row)
        top, index = _chunk_best(logits_row_ptr, seed, 1.0 / temperature, vocab_size, vocab_offset, chunk_start,
                                 CHUNK_V, BLOCK_V, SHIFT, True)
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


def choose_chunk_size(rows: int, vocab: int, num_sms: int) -> int:
    """Vocabulary entries per stage-one program for `rows` rows of `vocab` entries on `num_sms` SMs.

    The largest power of two in [_MIN_CHUNK_SIZE, DEFAULT_CHUNK_SIZE] that still gives
    `_MIN_PROGRAMS_PER_SM * num_sms` programs (never more than the slice rounded up to a power of
    two). Large chunks amortise each program's final reduction; small ones keep a small batch from
    leaving SMs idle. Any choice gives the same tokens.
    """
    chunk = DEFAULT_CHUNK_SIZE
    while chunk > _MIN_CHUNK_SIZE and rows * triton.cdiv(vocab, chunk) < _MIN_PROGRAMS_PER_SM * num_sms:
        chunk //= 2
    return min(chunk, max(_MIN_BLOCK, triton.next_power_of_2(vocab)))


def chunk_size_representatives(max_rows: int, vocab: int, num_sms: int) -> list[int]:
    """The smallest row count of each distinct `choose_chunk_size` over 1..`max_rows` rows: one call of
    `sample_candidates` at each compiles every kernel variant a batch of up to `max_rows` rows can need (the
    chunk size, and with it the tile, warp count and the reduction's block, are compile-time constants)."""
    firsts: dict[int, int] = {}
    for rows in range(1, max_rows + 1):
        firsts.setdefault(choose_chunk_size(rows, vocab, num_sms), rows)
    return sorted(firsts.values())


def compile_for_batches(max_rows: int, vocab: int, dtype: torch.dtype, device: torch.device,
                        vocab_offset: int = 0) -> None:
    """Compile `sample_candidates` for every batch of 1..`max_rows` rows of a `vocab`-entry slice starting at
    `vocab_offset`, in `dtype` logits, so that no batch size compiles a kernel in the middle of serving (a
    compile holds a step ~0.5 s)."""
    for rows in chunk_size_representatives(max_rows, vocab, _num_sms(device)):
        logits = torch.zeros(rows, vocab, dtype=dtype, device=device)
        temperatures = torch.ones(rows, dtype=torch.float32, device=device)
        sample_candidates(logits, temperatures, torch.zeros(rows, dtype=torch.int64, device=device),
                          vocab_offset=vocab_offset)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs one program at a time
    return torch.cuda.get_device_properties(device).multi_processor_count


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
            `choose_chunk_size(n, slice, SMs of the device)`. It changes the speed, never the token
            (exposed for tests and benchmarks).

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
        chunk_size = choose_chunk_size(n, vocab, _num_sms(logits.device))
    elif chunk_size < _MIN_BLOCK or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= {_MIN_BLOCK}, got {chunk_size}")
    scores = torch.empty(n, dtype=torch.float32, device=logits.device)
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    if not n:
        return scores, tokens
    block_v = min(_MAX_BLOCK_V, chunk_size)  # both powers of two: a chunk is whole blocks
    # Chunks (and so every tile of 4-entry groups) start at global multiples of 4: the first chunk
    # begins `shift` entries before the slice and masks them.
    shift = vocab_offset % _GROUP
    num_chunks = max(1, triton.cdiv(vocab + shift, chunk_size))
    best_score = torch.empty(n, num_chunks, dtype=torch.float32, device=logits.device)
    best_index = torch.empty(n, num_chunks, dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(n, num_chunks)](
        logits, logits.stride(0), temperatures, seeds, best_score, best_index, vocab, vocab_offset, num_chunks,
        CHUNK_V=chunk_size, BLOCK_V=block_v, SHIFT=shift, num_warps=4 if block_v >= 512 else 1,
    )
    _reduce_chunks_kernel[(n,)](
        best_score, best_index, scores, tokens, vocab, vocab_offset, num_chunks,
        BLOCK_C=max(_MIN_BLOCK, triton.next_power_of_2(num_chunks)), num_warps=1,
    )
    return scores, tokens
