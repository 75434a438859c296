"""Attention of one new query token per sequence over the paged KV cache (decode).

Flash-Decoding (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference", 2023):
when the batch alone cannot fill the GPU, each sequence's KV length is split over `num_splits`
programs, each producing a partial output and its log-sum-exp, and the partials are combined with
weights `exp(lse_s - max lse)` by a second kernel, or (`inline_combine`,
`DELTASERVE_DECODE_INLINE_COMBINE`) by the last of a (sequence, KV head)'s split programs to finish,
in the same launch (`gpu_kernels/split_counters.py`): a decode step of a 28-layer model at a small batch
launches 28 kernels fewer. Either way the splits are added in a fixed order, so the bits never
depend on which finished when. Everything is sized from host-side shapes, so a decode step can be
captured in a CUDA graph and replayed with any sequence lengths.
"""

import functools

import torch
import triton
import triton.language as tl

from common import envs
from gpu_kernels.kv_store import FP8_KV_DTYPE
from gpu_kernels.paged_attention import (
    LOG2_E,
    MIN_DOT_ROWS,
    attend_kv_tile,
    check_paged_attention_args,
    dot_precision,
    query_for_cache,
)
from gpu_kernels.pdl import launch_options, pdl_for, wait_then_release
from gpu_kernels.split_counters import split_counters

# Programs wanted in flight: about four per SM of an H100/H200 (132 SMs).
_TARGET_PROGRAMS = 512
_MAX_SPLITS = 16
# A split shorter than this many tokens costs more in the combine than it saves.
_MIN_TOKENS_PER_SPLIT = 256


# The block-table stride is the step's block-table width, different from step to step: specializing on it
# (Triton compiles separate variants for 1, multiples of 16 and the rest) compiled a new variant in the middle
# of a run, over a second of host time.
@triton.jit(do_not_specialize=["stride_block_table"])
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    counter_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    scale_log2,
    v_scale,
    stride_q_seq,
    stride_q_head,
    stride_out_seq,
    stride_out_head,
    stride_block_table,
    stride_slot,
    num_q_heads,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    COMBINE: tl.constexpr,
):
    # Program (seq, kv_head, split) owns the GROUP query heads of one KV head and the KV
    # positions [split_start, split_end) of one sequence.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:  # gpu_kernels/pdl.py: the kernel before this one has finished and its memory is visible
        tl.extra.cuda.gdc_wait()

    seq_len = tl.load(seq_lens_ptr + seq)
    # Splits are whole tiles, so only the sequence's last tile needs a mask. A padding row
    # (seq_len == 0) gets empty ranges and reads neither its block table row nor the cache.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)
    unmasked_end = tl.maximum(split_start, split_end // BLOCK_N * BLOCK_N)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    io_mask = (rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :], mask=io_mask, other=0.0
    )
    q = query_for_cache(q, k_cache_ptr)
    q_pos = tl.zeros([BLOCK_H], dtype=tl.int32) + (seq_len - 1)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    block_table_row_ptr = block_tables_ptr + seq * stride_block_table
    kv_head_offset = kv_head * HEAD_DIM
    for tile_start in range(split_start, unmasked_end, BLOCK_N):
        acc, m_i, l_i = attend_kv_tile(
            acc, m_i, l_i, q, q_pos, tile_start, seq_len, block_table_row_ptr, k_cache_ptr, v_cache_ptr,
            kv_head_offset, stride_slot, scale_log2,
            BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, False, DOT_PRECISION,
        )
    for tile_start in range(unmasked_end, split_end, BLOCK_N):
        acc, m_i, l_i = attend_kv_tile(
            acc, m_i, l_i, q, q_pos, tile_start, seq_len, block_table_row_ptr, k_cache_ptr, v_cache_ptr,
            kv_head_offset, stride_slot, scale_log2,
            BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, True, DOT_PRECISION,
        )

    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # An empty range leaves l_i == 0 and acc == 0: its output is zero and its lse is -inf.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )
    else:
        partial_row = (seq * num_q_heads + heads) * NUM_SPLITS + split
        tl.store(partial_out_ptr + partial_row[:, None] * BLOCK_D + dims[None, :], out, mask=io_mask)
        lse = m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0))  # m_i is -inf where l_i == 0
        tl.store(partial_lse_ptr + partial_row, lse, mask=rows < GROUP)
        if COMBINE:
            # The last of the NUM_SPLITS programs of (seq, kv_head) to get here combines their partials
            # (gpu_kernels/split_counters.py); all of this program's partials are stored before its counter release.
            counter = counter_ptr + seq * tl.num_programs(1) + kv_head
            tl.debug_barrier()
            if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SPLITS - 1:
                _combine_group(partial_out_ptr, partial_lse_ptr, out_ptr, seq, kv_head, stride_out_seq,
                               stride_out_head, num_q_heads, GROUP, GROUP_P2, HEAD_DIM, BLOCK_D, NUM_SPLITS)
                tl.store(counter, 0)  # no other program of this launch touches it again


@triton.jit
def _combine_group(partial_out_ptr, partial_lse_ptr, out_ptr, seq, kv_head, stride_out_seq, stride_out_head,
                   num_q_heads, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    # out[seq, h] for the GROUP query heads h of kv_head = the sum over splits s of 2^(lse_s - max lse) * partial_s,
    # over the sum of the weights. Every split's partial is visible (the counter's acquire); all of them are read at
    # once, from L2 (.cg) past this SM's L1: one round trip, not one per split.
    rows = tl.arange(0, GROUP_P2)
    heads = kv_head * GROUP + rows
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    partial_rows = (seq * num_q_heads + heads)[:, None] * NUM_SPLITS + splits[None, :]  # [GROUP_P2, NUM_SPLITS]
    row_mask = (rows < GROUP)[:, None]
    lse = tl.load(partial_lse_ptr + partial_rows, mask=row_mask, other=float("-inf"), cache_modifier=".cg")
    partial = tl.load(partial_out_ptr + partial_rows[:, :, None] * BLOCK_D + dims[None, None, :],
                      mask=row_mask[:, :, None] & (dims < HEAD_DIM)[None, None, :], other=0.0, cache_modifier=".cg")
    lse_max = tl.max(lse, 1)
    lse_max = tl.where(lse_max > float("-inf"), lse_max, 0.0)
    weights = tl.math.exp2(lse - lse_max[:, None])  # an empty split has lse -inf and weight 0
    total = tl.sum(weights, 1)
    # All splits empty means a padding row (seq_len == 0): its output is zero.
    out = tl.sum(weights[:, :, None] * partial, 1) / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask & (dims < HEAD_DIM)[None, :])


@triton.jit
def _combine_splits_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    stride_out_seq,
    stride_out_head,
    num_q_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (seq, q_head) merges NUM_SPLITS partial outputs, each normalised by its own softmax
    # sum, with weights 2^(lse_s - max lse); lse is in base 2.
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    first_row = (seq * num_q_heads + head) * NUM_SPLITS
    wait_then_release(PDL)  # no loop: the successor may launch at once (it waits for this one)
    lse = tl.load(partial_lse_ptr + first_row + splits)
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max > float("-inf"), lse_max, 0.0)
    weights = tl.math.exp2(lse - lse_max)  # an empty split has lse -inf and weight 0
    total = tl.sum(weights, 0)
    partial = tl.load(
        partial_out_ptr + (first_row + splits)[:, None] * BLOCK_D + dims[None, :],
        mask=(dims < HEAD_DIM)[None, :],
        other=0.0,
    )
    # All splits empty means a padding row (seq_len == 0): its output is zero.
    out = tl.sum(weights[:, None] * partial, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@functools.cache
def _inline_combine_requested() -> bool:
    return envs.decode_inline_combine()


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_blocks_per_seq: int, block_size: int) -> int:
    """Number of KV splits per sequence for decode, a power of two in [1, 16].

    Splits until about `_TARGET_PROGRAMS` programs run, but never below `_MIN_TOKENS_PER_SPLIT`
    tokens per split at the longest context the block table can hold. Uses host-side shapes only.
    """
    programs = max(1, num_seqs * num_kv_heads)
    wanted = triton.cdiv(_TARGET_PROGRAMS, programs)
    affordable = max(1, max_blocks_per_seq * block_size // _MIN_TOKENS_PER_SPLIT)
    splits = max(1, min(wanted, affordable, _MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


def reachable_num_splits(max_num_seqs: int, num_kv_heads: int, max_blocks_per_seq: int, block_size: int) -> list[int]:
    """Every `choose_num_splits` value a decode of 1..`max_num_seqs` sequences can pick with a block table of
    1..`max_blocks_per_seq` columns, ascending. Each is its own compiled kernel (NUM_SPLITS and the launch
    configuration are compile-time constants): a worker compiles them all at start-up (`compile_decode_variants`).
    An eager step's table is only as wide as its longest sequence, so short contexts pick fewer splits than the
    CUDA graphs (captured at the full width) ever do."""
    return sorted({choose_num_splits(n, num_kv_heads, w, block_size)
                   for n in range(1, max_num_seqs + 1) for w in (1, max_blocks_per_seq)}
                  | {choose_num_splits(1, num_kv_heads, w, block_size) for w in range(1, max_blocks_per_seq + 1)})


def compile_decode_variants(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, splits: list[int],
                            softmax_scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Launch `paged_attention_decode` once per split count in `splits` on one padding row (seq_len 0: it reads
    and writes no cache entry), so that each variant is compiled before serving: a compile mid-run holds a step
    0.3-2 s. `q`: `[1, num_q_heads, head_dim]` like the engine's (its dtype and layout); the caches: a layer's."""
    block_tables = torch.zeros(1, 1, dtype=torch.int32, device=q.device)
    seq_lens = torch.zeros(1, dtype=torch.int32, device=q.device)
    for num_splits in splits:
        paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, num_splits=num_splits,
                               k_scale=k_scale, v_scale=v_scale)


def _decode_launch_config(head_dim: int, cache_dtype: torch.dtype, num_splits: int) -> tuple[int, int, int]:
    """(BLOCK_N keys per tile, num_warps, num_stages), tuned on an H200 (`benchmarks/kernel_bench.py sweep`).

    Unsplit (a large batch), 128-key tiles: bf16 287 us against 299 us for 64-key tiles at batch 256 and
    contexts 100..2000 (3.97 TB/s), and an fp8 cache 218 us against 316 us (its tile is widened to fp16 in
    registers, so fewer, longer tiles pay more). Split (a small batch), 64-key tiles keep the splits fine.
    """
    if head_dim > 128:
        return 32, 4, 2
    if num_splits > 1:
        return 64, 4, 3
    if cache_dtype == FP8_KV_DTYPE:
        return 128, 4, 2
    return 128, 4, 4


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    launch_config: tuple[int, int, int] | None = None,
    inline_combine: bool | None = None,
) -> torch.Tensor:
    """Attention of each sequence's newest token over its whole KV history in the paged cache.

    Args:
        q: `[num_seqs, num_q_heads, head_dim]`, bf16/fp16 (fp32 allowed); the query of sequence
            b sits at position `seq_lens[b] - 1`. Last-dimension stride 1.
        k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous, q's
            dtype or float8 e4m3fn, already holding this step's key and value. `num_q_heads`
            must be a multiple of `num_kv_heads`.
        block_tables: `[num_seqs, max_blocks_per_seq]` int32 cache block ids; only the first
            `ceil(seq_lens[b] / block_size)` entries of row b are read.
        seq_lens: `[num_seqs]` int32, KV length in tokens including the new token. A row with
            `seq_lens[b] == 0` is padding (e.g. for a CUDA graph): its output is zeros and
            neither its block table row nor the cache is read.
        softmax_scale: multiplier of `q . k` before the softmax, usually `head_dim ** -0.5`.
        out: optional `[num_seqs, num_q_heads, head_dim]` output in q's dtype.
        num_splits: KV splits per sequence (Flash-Decoding), a power of two. None picks one from
            the batch size, head count and block-table width (`choose_num_splits`).
        k_scale, v_scale: an fp8 cache's dequantization scales (key = code * k_scale); 1.0 for a
            cache in q's dtype.
        launch_config: (BLOCK_N keys per tile, num_warps, num_stages) in place of the tuned default
            (`_decode_launch_config`); for tuning runs (benchmarks/kernel_bench.py sweep).
        inline_combine: with several splits, the last split program of each (sequence, KV
            head) to finish combines the splits in the same launch, instead of a second
            kernel; None reads `DELTASERVE_DECODE_INLINE_COMBINE` (off by default until timed
            on a GPU: benchmarks/RESULTS.md).

    Returns:
        `out`, `[num_seqs, num_q_heads, head_dim]` in q's dtype; accumulation is fp32.

    Raises:
        ValueError: on mismatched shapes, dtypes or strides, a num_splits that is not a
            positive power of two, or a scale that is not positive and finite (or not 1.0 where
            the cache is not fp8); with inline_combine None, a DELTASERVE_DECODE_INLINE_COMBINE
            that is not a boolean word.

    Algorithm: FlashAttention-2 online softmax per split, Flash-Decoding log-sum-exp combine.
    No tensor value is read on the host, so the call is CUDA-graph capturable.
    """
    out = check_paged_attention_args(q, k_cache, v_cache, block_tables, seq_lens, out, k_scale, v_scale)
    num_seqs, num_q_heads, head_dim = q.shape
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, block_tables.shape[1], block_size)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a positive power of two, got {num_splits}")
    if num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    block_n, num_warps, num_stages = launch_config or _decode_launch_config(head_dim, k_cache.dtype, num_splits)
    pdl = pdl_for(q)
    combine_inline = num_splits > 1 and (_inline_combine_requested() if inline_combine is None else inline_combine)
    counters = seq_lens  # unused unless the splits are combined inline
    if num_splits == 1:
        partial_out = partial_lse = out  # unused: the kernel writes `out` directly
    else:
        partial_out = torch.empty(
            (num_seqs, num_q_heads, num_splits, block_d), dtype=torch.float32, device=q.device
        )
        partial_lse = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
        if combine_inline:
            # choose_num_splits splits only below _TARGET_PROGRAMS (seq, KV head) programs
            counters = split_counters(q.device, num_seqs * num_kv_heads, "paged decode", _TARGET_PROGRAMS)
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        partial_out,
        partial_lse,
        counters,
        block_tables,
        seq_lens,
        softmax_scale * k_scale * LOG2_E,
        v_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        num_kv_heads * head_dim,
        num_q_heads,
        GROUP=group,
        GROUP_P2=triton.next_power_of_2(group),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        DOT_PRECISION=dot_precision(q),
        PDL=pdl,
        COMBINE=combine_inline,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_options(pdl),
    )
    if num_splits > 1 and not combine_inline:
        _combine_splits_kernel[(num_seqs, num_q_heads)](
            partial_out,
            partial_lse,
            out,
            out.stride(0),
            out.stride(1),
            num_q_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            PDL=pdl,
            num_warps=4,
            **launch_options(pdl),
        )
    return out
