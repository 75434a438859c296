"""Batch-invariant paged attention (deterministic mode, workers/deterministic.py): a query token's output bits do not
depend on the step it is computed in, a prefill chunk of any size, a decode row among any number of others, a
CUDA graph bucket, and yet a lone decode row is split over the GPU like Flash-Decoding.

The keys of a query at position `p` are cut into splits of `SPLIT_TOKENS` positions from 0 (split `s` holds
`s * SPLIT_TOKENS .. (s + 1) * SPLIT_TOKENS - 1`; the query sees splits `0 .. p // SPLIT_TOKENS`). Each split runs
the FlashAttention-2 online softmax over its `BLOCK_N` key tiles from a fresh state `(m, l, acc)` (running max in
base 2, running sum, unnormalised output), every tile on the causal-mask path; the split states are then folded
left to right into one, starting from `(-inf, 0, 0)`, by `merge_split`:

    m' = max(m, m_s),  a = 2^(m - m'),  b = 2^(m_s - m'),  l' = fma(l, a, l_s * b),  acc' = fma(acc, a, acc_s * b)

and the output is `acc / l`. The split size, the tiles, the fold order and every operation are fixed by the
query's position alone; the explicit fused multiply-adds leave the compiler no contraction to choose. Two ways to
run it give the same bits:
- in place (`parallel=False`, any batch: prefill chunks, mixed steps, large decode batches): one program per
  (sequence, query tile, KV head) folds its splits as it goes; a split that starts after a query's position
  leaves that query's state as it was (as if the split did not exist);
- split-parallel (`parallel=True`, decode steps of few rows): one program per (sequence, split, KV head) writes its
  split's state, and the last of a (sequence, KV head)'s split programs to finish (`gpu_kernels/split_counters.py`)
  folds them in the same order, in the same launch. A batch-1 decode row at 600 tokens then runs on 5 x KV-heads
  programs of 2 tiles instead of KV-heads programs of 10.
Which way a step runs is chosen from host shapes (`deterministic_attention`); it never changes a bit.

The source of the split idea: Flash-Decoding (Dao et al., 2023) with a fixed split size in tokens rather than a
fixed split count, as Thinking Machines' "Defeating Nondeterminism in LLM Inference" (2025) proposes for
batch-invariant decode attention.
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
from gpu_kernels.pdl import launch_options, pdl_for
from gpu_kernels.split_counters import split_counters

SPLIT_TOKENS = 128
BLOCK_N = 64
_NUM_WARPS, _NUM_STAGES = 4, 2
# Split-parallel only while the (sequence, KV head) programs alone fill less than about two waves of an H200's
# 132 SMs, and its split states stay small.
_PARALLEL_BELOW_PROGRAMS = 256
_PARALLEL_MAX_STATE_BYTES = 64 << 20


@triton.jit
def merge_split(m, denom, acc, m_s, denom_s, acc_s, take):
    """Fold one split's state `(m_s [R], denom_s [R], acc_s [R, D])` (the module docstring's `l` is `denom`) into
    the running `(m, denom, acc)` for the rows where `take` ([R] bool) holds; the others keep theirs. `m` may be
    -inf (nothing folded yet); `m_s` is finite where `take` holds."""
    m_new = tl.maximum(m, m_s)
    a = tl.math.exp2(m - m_new)
    b = tl.math.exp2(m_s - m_new)
    denom_new = tl.fma(denom, a, denom_s * b)
    acc_new = tl.fma(acc, a[:, None], acc_s * b[:, None])
    return tl.where(take, m_new, m), tl.where(take, denom_new, denom), tl.where(take[:, None], acc_new, acc)


@triton.jit
def _normalise(acc, denom, v_scale):
    # A padding row of a CUDA graph (seq_len 0) sees no key: zeros, as the default kernels write.
    return tl.where(denom[:, None] > 0, acc / tl.where(denom > 0, denom, 1.0)[:, None], 0.0) * v_scale


# Arguments that change from step to step are not specialized on (Triton compiles a variant for 1 and for multiples of
# 16): max_splits follows the step's longest block table, 1 for a step of short sequences only, and a variant the
# warm-up did not make would compile mid-run (one did, at step 64 of benchmarks/throughput.py --deterministic).
@triton.jit(do_not_specialize=["stride_block_table", "max_splits"])
def _deterministic_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    state_m_ptr,
    state_l_ptr,
    state_acc_ptr,
    counter_ptr,
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
    num_q_heads,
    max_splits,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr,
    PARALLEL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    # In place: program (seq, q_block, kv_head) owns BLOCK_Q query tokens of one sequence times the GROUP query
    # heads of one KV head (row r is token q_block * BLOCK_Q + r // GROUP, head r % GROUP) and folds every split.
    # Split-parallel (one query token per sequence): program (seq, split, kv_head) computes one split's state; the
    # last of the row's split programs to finish folds them all.
    seq = tl.program_id(0)
    kv_head = tl.program_id(2)
    if PDL:  # gpu_kernels/pdl.py: the kernel before this one has finished and its memory is visible
        tl.extra.cuda.gdc_wait()
    if PARALLEL:
        q_block = 0
        split_first = tl.program_id(1)
    else:
        q_block = tl.num_programs(1) - 1 - tl.program_id(1)  # later query tiles see more keys: launch them first
        split_first = 0

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_q = q_block * BLOCK_Q
    if first_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    last_q = tl.minimum(first_q + BLOCK_Q, q_len) - 1
    kv_end = context_len + last_q + 1
    if PARALLEL:
        split_end = split_first + 1
        # Past this row's position: no state of it is folded. Split 0 runs even for a row that sees no key (a
        # padding row, seq_len 0), so that someone writes its zeros.
        if split_first * SPLIT_TOKENS >= tl.maximum(kv_end, 1):
            return
    else:
        split_end = tl.cdiv(kv_end, SPLIT_TOKENS)

    q, q_pos, row_valid, heads, dims, token, io_mask = load_query_tile(
        q_ptr, k_cache_ptr, q_start, first_q, last_q, context_len, kv_head, stride_q_token, stride_q_head,
        GROUP, BLOCK_Q, BLOCK_M, BLOCK_D, HEAD_DIM,
    )
    block_table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    kv_head_offset = kv_head * HEAD_DIM

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for split in range(split_first, split_end):
        split_start = split * SPLIT_TOKENS
        m_s = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_s = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc_s = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # The split's first key is visible to every row that takes the split, so no taken row meets an all -inf
        # tile first; rows that do not take it may compute NaN here, which merge_split's `take` drops.
        for tile_start in range(split_start, tl.minimum(split_start + SPLIT_TOKENS, kv_end), BLOCK_N):
            acc_s, m_s, l_s = attend_kv_tile(
                acc_s, m_s, l_s, q, q_pos, tile_start, kv_end, block_table_row_ptr, k_cache_ptr, v_cache_ptr,
                kv_head_offset, stride_slot, scale_log2,
                BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, True, DOT_PRECISION,
            )
        m_i, l_i, acc = merge_split(m_i, l_i, acc, m_s, l_s, acc_s, split_start <= q_pos)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()

    if PARALLEL:
        # State of (seq, split, head): m and l at [seq, split, head], acc at [seq, split, head, :BLOCK_D].
        state_rows = (seq.to(tl.int64) * max_splits) * num_q_heads + heads
        split_stride = num_q_heads
        tl.store(state_m_ptr + state_rows + split_first * split_stride, m_i, mask=row_valid)
        tl.store(state_l_ptr + state_rows + split_first * split_stride, l_i, mask=row_valid)
        tl.store(state_acc_ptr + (state_rows + split_first * split_stride)[:, None] * BLOCK_D + dims[None, :], acc,
                 mask=row_valid[:, None])
        # The last of the row's split programs to get here folds every split's state left to right, as the in-place
        # way does (gpu_kernels/split_counters.py): this program's states are stored before its counter release,
        # and the others' are visible after its acquire; they are read from L2 (.cg), past this SM's L1.
        num_splits = tl.cdiv(kv_end, SPLIT_TOKENS)  # 0 for a row that sees no key: its output is zeros
        counter = counter_ptr + seq * tl.num_programs(2) + kv_head
        tl.debug_barrier()
        if tl.atomic_add(counter, 1, sem="acq_rel") == tl.maximum(num_splits, 1) - 1:
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            for split in range(0, num_splits):
                rows_s = state_rows + split * split_stride
                m_s = tl.load(state_m_ptr + rows_s, mask=row_valid, other=0.0, cache_modifier=".cg")
                l_s = tl.load(state_l_ptr + rows_s, mask=row_valid, other=0.0, cache_modifier=".cg")
                acc_s = tl.load(state_acc_ptr + rows_s[:, None] * BLOCK_D + dims[None, :], mask=row_valid[:, None],
                                other=0.0, cache_modifier=".cg")
                m_i, l_i, acc = merge_split(m_i, l_i, acc, m_s, l_s, acc_s, split * SPLIT_TOKENS <= q_pos)
            tl.store(out_ptr + token[:, None] * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
                     _normalise(acc, l_i, v_scale).to(out_ptr.dtype.element_ty), mask=io_mask)
            tl.store(counter, 0)  # no other program of this launch touches it again
    else:
        tl.store(out_ptr + token[:, None] * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
                 _normalise(acc, l_i, v_scale).to(out_ptr.dtype.element_ty), mask=io_mask)


def launch_rows(group: int) -> int:
    """BLOCK_M, the query rows of every program: MIN_DOT_ROWS (the smallest tl.dot), or the GQA group if larger, so
    that a decode row (one token's query heads of one KV head) does not compute a 128-row tile. Fixed per model:
    a row's q . k and p . v come from dot products of one shape in every step."""
    return max(MIN_DOT_ROWS, triton.next_power_of_2(group))


def choose_parallel(num_seqs: int, max_query_len: int, num_kv_heads: int, num_q_heads: int, head_dim: int,
                    max_kv_len: int) -> bool:
    """Whether a step runs split-parallel (decode rows only, few programs in place, small split states). Host
    shapes only, so a CUDA graph bucket always makes the same choice; either choice gives the same bits."""
    if max_query_len != 1 or num_seqs * num_kv_heads >= _PARALLEL_BELOW_PROGRAMS:
        return False
    state_bytes = num_seqs * triton.cdiv(max_kv_len, SPLIT_TOKENS) * num_q_heads * (
        triton.next_power_of_2(head_dim) + 2) * 4
    return state_bytes <= _PARALLEL_MAX_STATE_BYTES


def deterministic_attention(
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
    parallel: bool | None = None,
) -> torch.Tensor:
    """Causal varlen attention of new query tokens over the paged KV cache whose per-token bits do not depend on
    the batch, the chunk or the step kind (the module docstring gives the order of operations).

    Args:
        q: `[num_tokens, num_q_heads, head_dim]`, bf16/fp16/fp32, the query tokens of all sequences concatenated;
            last-dimension stride 1.
        k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous, q's dtype or float8
            e4m3fn, already holding this step's keys and values.
        block_tables: `[num_seqs, max_blocks_per_seq]` int32; only the first `ceil(seq_lens[b] / block_size)`
            entries of row b are read.
        query_start_loc: `[num_seqs + 1]` int32 cumulative query counts; sequence b's queries are its last
            `q_len_b` positions (`seq_lens[b] - q_len_b ..`).
        seq_lens: `[num_seqs]` int32 KV lengths including this step's tokens; 0 marks a padding row (zeros out).
        max_query_len: host int, an upper bound on every `q_len_b`.
        softmax_scale: multiplier of `q . k`, usually `head_dim ** -0.5`.
        out: optional `[num_tokens, num_q_heads, head_dim]` output in q's dtype.
        k_scale, v_scale: an fp8 cache's dequantization scales; 1.0 otherwise.
        parallel: split-parallel (only when every sequence has one query token, `max_query_len == 1`) or in place;
            None picks by `choose_parallel`. The bits are the same either way.

    Returns:
        `out`, `[num_tokens, num_q_heads, head_dim]` in q's dtype; accumulation is fp32.

    Raises:
        ValueError: on mismatched shapes, dtypes or strides, a bad scale, or `parallel=True` with
            `max_query_len != 1`; checked on the host, no sync. CUDA-graph capturable.
        RuntimeError: the first split-parallel call on a device (which allocates the split counters,
            gpu_kernels/split_counters.py) runs inside a CUDA graph capture.
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
    max_kv_len = block_tables.shape[1] * block_size
    if parallel is None:
        parallel = choose_parallel(num_seqs, max_query_len, num_kv_heads, num_q_heads, head_dim, max_kv_len)
    elif parallel and max_query_len != 1:
        raise ValueError(f"split-parallel attention takes decode rows only (max_query_len 1), got {max_query_len}")
    block_m = launch_rows(group)
    block_q = block_m // group
    block_d = triton.next_power_of_2(head_dim)
    max_splits = triton.cdiv(max_kv_len, SPLIT_TOKENS)
    if parallel:
        state_m = torch.empty((num_seqs, max_splits, num_q_heads), dtype=torch.float32, device=q.device)
        state_l = torch.empty_like(state_m)
        state_acc = torch.empty((num_seqs, max_splits, num_q_heads, block_d), dtype=torch.float32, device=q.device)
        grid = (num_seqs, max_splits, num_kv_heads)
        # choose_parallel runs split-parallel only below _PARALLEL_BELOW_PROGRAMS (sequence, KV head) programs
        counters = split_counters(q.device, num_seqs * num_kv_heads, "deterministic attention",
                                  _PARALLEL_BELOW_PROGRAMS)
    else:
        state_m = state_l = state_acc = counters = out  # unused
        grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    pdl = pdl_for(q)
    _deterministic_attention_kernel[grid](
        q, k_cache, v_cache, out, state_m, state_l, state_acc, counters, block_tables, query_start_loc, seq_lens,
        softmax_scale * k_scale * LOG2_E, v_scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), num_kv_heads * head_dim, num_q_heads, max_splits,
        GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=BLOCK_N, SPLIT_TOKENS=SPLIT_TOKENS, PARALLEL=parallel,
        DOT_PRECISION=dot_precision(q, exact_rows=True), PDL=pdl, num_warps=_NUM_WARPS,
        num_stages=_NUM_STAGES, **launch_options(pdl),
    )
    return out
