"""Causal attention of a varlen batch of query tokens over the paged KV cache (prefill).

Covers plain prefill, prefill after a prefix-cache hit, later chunks of a chunked prefill, and
decode rows (one query token) mixed into the same batch: in every case the queries of a sequence
are its last `q_len` positions and all keys, old and new, are read from the paged cache.
"""

import torch
import triton
import triton.language as tl

from gpu_kernels.paged_attention import (
    LOG2_E,
    MIN_DOT_ROWS,
    attend_kv_tile,
    check_paged_attention_args,
    dot_precision,
    load_query_tile,
)


# The block-table stride is the step's block-table width, different from step to step: specializing on it
# (Triton compiles separate variants for 1, multiples of 16 and the rest) compiled a new variant in the middle
# of a run, over a second of host time.
@triton.jit(do_not_specialize=["stride_block_table"])
def _paged_prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
    v_scale,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_block_table,
    stride_slot,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Program (seq, q_block, kv_head) owns BLOCK_Q query tokens of one sequence times the GROUP
    # query heads of one KV head: row r is token q_block * BLOCK_Q + r // GROUP, head r % GROUP.
    seq = tl.program_id(0)
    # Later query tiles see more keys; launching them first shortens the tail of the grid.
    q_block = tl.num_programs(1) - 1 - tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_q = q_block * BLOCK_Q
    if first_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # positions before this step's first query token
    last_q = tl.minimum(first_q + BLOCK_Q, q_len) - 1

    q, q_pos, _, heads, dims, token, io_mask = load_query_tile(
        q_ptr, k_cache_ptr, q_start, first_q, last_q, context_len, kv_head, stride_q_token, stride_q_head,
        GROUP, BLOCK_Q, BLOCK_M, BLOCK_D, HEAD_DIM,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    block_table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    kv_head_offset = kv_head * HEAD_DIM
    kv_end = context_len + last_q + 1
    # Tiles wholly at or before the first query's position need no causal mask.
    unmasked_end = (context_len + first_q + 1) // BLOCK_N * BLOCK_N
    for tile_start in range(0, unmasked_end, BLOCK_N):
        acc, m_i, l_i = attend_kv_tile(
            acc, m_i, l_i, q, q_pos, tile_start, kv_end, block_table_row_ptr, k_cache_ptr, v_cache_ptr,
            kv_head_offset, stride_slot, scale_log2,
            BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, False, DOT_PRECISION,
        )
    for tile_start in range(unmasked_end, kv_end, BLOCK_N):
        acc, m_i, l_i = attend_kv_tile(
            acc, m_i, l_i, q, q_pos, tile_start, kv_end, block_table_row_ptr, k_cache_ptr, v_cache_ptr,
            kv_head_offset, stride_slot, scale_log2,
            BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, True, DOT_PRECISION,
        )

    # A padding row of a CUDA graph (seq_len 0) sees no key: zeros, as the decode kernel writes.
    out = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0) * v_scale
    tl.store(
        out_ptr + token[:, None] * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def _prefill_launch_config(group: int, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M query rows, BLOCK_N keys, num_warps, num_stages), tuned for Hopper."""
    if head_dim <= 128:
        block_m, block_n, num_warps, num_stages = 128, 64, 8, 3
    else:
        block_m, block_n, num_warps, num_stages = 64, 32, 4, 2
    return max(block_m, MIN_DOT_ROWS, triton.next_power_of_2(group)), block_n, num_warps, num_stages


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    softmax_scale: float,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal varlen attention of new query tokens over the paged KV cache.

    Args:
        q: `[num_tokens, num_q_heads, head_dim]`, bf16/fp16 (fp32 allowed); the query tokens of
            all sequences concatenated. Last-dimension stride 1; other strides are free.
        k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous, q's
            dtype or float8 e4m3fn, already holding this step's keys and values (see `store_kvcache`).
            `num_q_heads` must be a multiple of `num_kv_heads` (GQA/MQA/MHA).
        block_tables: `[num_seqs, max_blocks_per_seq]` int32 cache block ids. Only the first
            `ceil(seq_lens[b] / block_size)` entries of row b are read; the rest may hold anything.
        query_start_loc: `[num_seqs + 1]` int32, cumulative query counts (`cu_seqlens_q`).
        seq_lens: `[num_seqs]` int32, KV length of each sequence in tokens, including this
            step's query tokens. Query i of sequence b (`q_len_b` queries) sits at position
            `seq_lens[b] - q_len_b + i` and attends to keys at positions `0..` that position.
        max_query_len: host int, an upper bound on every `q_len_b` (sets the grid).
        softmax_scale: multiplier of `q . k` before the softmax, usually `head_dim ** -0.5`.
        out: optional `[num_tokens, num_q_heads, head_dim]` output in q's dtype.
        k_scale, v_scale: an fp8 cache's dequantization scales (key = code * k_scale); 1.0 for a
            cache in q's dtype.

    Returns:
        `out`, `[num_tokens, num_q_heads, head_dim]` in q's dtype; accumulation is fp32.

    Raises:
        ValueError: on mismatched shapes, dtypes or strides, or a scale that is not positive and
            finite (or not 1.0 where the cache is not fp8); checked on the host, no sync.

    Algorithm: FlashAttention-2 forward (Dao 2023) with the online softmax, over KV tiles
    gathered through the block table; one program per (sequence, query tile, KV head) serving all
    query heads of that KV head.
    """
    out = check_paged_attention_args(q, k_cache, v_cache, block_tables, seq_lens, out, k_scale, v_scale)
    num_seqs = block_tables.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or query_start_loc.dtype != torch.int32:
        raise ValueError(f"query_start_loc must be int32 [{num_seqs + 1}], got "
                         f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    block_m, block_n, num_warps, num_stages = _prefill_launch_config(group, head_dim)
    block_q = block_m // group
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _paged_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        softmax_scale * k_scale * LOG2_E,
        v_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        num_kv_heads * head_dim,
        GROUP=group,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
