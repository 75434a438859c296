"""What paged prefill and paged decode share: the cache layout, argument checks, one tile step.

Cache layout (FlashAttention's paged layout): `k_cache` and `v_cache` are `[num_blocks,
block_size, num_kv_heads, head_dim]`, contiguous. Token position `p` of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size`. A KV tile of `BLOCK_N` consecutive
positions is gathered slot by slot, so a tile may span several cache blocks and any block size
works (including 1 and non-powers of two).

Both kernels run the FlashAttention-2 online softmax (Dao, "FlashAttention-2: Faster Attention
with Better Parallelism and Work Partitioning", 2023, Algorithm 1) in base 2: scores are
multiplied by `softmax_scale * log2(e)` so that `exp2` replaces `exp`.

Grouped-query attention: one program owns one KV head and all `num_q_heads // num_kv_heads`
query heads that read it, so every KV tile is loaded once per group. Query rows are padded to at
least 16 so that `tl.dot` can use tensor cores.

fp8 KV cache: the caches may hold float8 e4m3fn codes with one dequantization scale for the keys
and one for the values of the layer (`gpu_kernels/kv_store.py`). A tile is widened as it is loaded, to fp16
for a bf16 q (`query_for_cache`: one conversion instruction per two values on sm89+, where e4m3 -> bf16
takes several) and to q's dtype otherwise, exactly in both (every e4m3 value is a bf16 and an fp16
value); the scales never touch a tile: `q . (s_k k) = s_k (q . k)` goes into the softmax scale,
and `sum_j p_j (s_v v_j)` is multiplied by `s_v` once, with the output.
"""

import math

import torch
import triton
import triton.language as tl

from gpu_kernels.kv_store import FP8_KV_DTYPE, check_kv_scales

LOG2_E = math.log2(math.e)
MIN_DOT_ROWS = 16


@triton.jit
def query_for_cache(q, k_cache_ptr):
    """`q` in the dtype the cache's tiles are widened to: a bf16 q over an fp8 cache becomes fp16 (clamped to
    fp16's range), so that a tile widens with PTX's `cvt.rn.f16x2.e4m3x2` (sm89+: one instruction per two
    values) rather than through fp16 and fp32 to bf16, which is what the H200 run suggests the 0.85x fp8 figure
    paid for (to be measured: benchmarks/RESULTS.md). Exact either way (every e4m3 value is an fp16 value), and
    fp16 holds q with 3 more mantissa bits than bf16. Any other q is returned as loaded."""
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def load_query_tile(q_ptr, k_cache_ptr, q_start, first_q, last_q, context_len, kv_head, stride_q_token,
                    stride_q_head, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The `[BLOCK_M, BLOCK_D]` query tile of a program owning queries `first_q .. last_q` of one sequence (its
    queries start at row `q_start` of q, after `context_len` earlier positions) times the GROUP query heads of
    `kv_head`: row r is query `first_q + r // GROUP`, head `kv_head * GROUP + r % GROUP`. Returns (q as
    `query_for_cache` gives it, q_pos `[BLOCK_M]` each row's position, row_valid, heads, dims, token (each row's
    int64 row of q and of the output), io_mask); padding rows load zeros and are never to be stored."""
    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_idx <= last_q)
    q_pos = context_len + q_idx  # of padding rows too; their outputs are never stored
    heads = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, BLOCK_D)
    token = (q_start + q_idx).to(tl.int64)
    io_mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + token[:, None] * stride_q_token + heads[:, None] * stride_q_head + dims[None, :],
                mask=io_mask, other=0.0)
    return query_for_cache(q, k_cache_ptr), q_pos, row_valid, heads, dims, token, io_mask


@triton.jit
def attend_kv_tile(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    tile_start,
    kv_end,
    block_table_row_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_head_offset,
    stride_slot,
    scale_log2,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over the KV positions `tile_start .. tile_start + BLOCK_N - 1`.

    `q` is `[BLOCK_M, BLOCK_D]`, `q_pos` `[BLOCK_M]` the position of each query row; `acc`
    (`[BLOCK_M, BLOCK_D]` fp32), `m_i` (running max, base 2) and `l_i` (running sum) are the
    FlashAttention-2 state. With `MASKED`, key `p` is used by row `r` only if `p <= q_pos[r]`,
    and neither the block table nor the cache is read at positions `>= kv_end` (which must
    exceed every `q_pos`); without it, every position of the tile must be visible to every row.
    """
    positions = tile_start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    if MASKED:
        in_range = positions < kv_end
        block_ids = tl.load(block_table_row_ptr + positions // BLOCK_SIZE, mask=in_range, other=0)
    else:
        block_ids = tl.load(block_table_row_ptr + positions // BLOCK_SIZE)
    slots = block_ids.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
    offsets = slots[:, None] * stride_slot + kv_head_offset + dims[None, :]
    if MASKED:
        kv_mask = in_range[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0)
    elif HEAD_DIM == BLOCK_D:
        k = tl.load(k_cache_ptr + offsets)
        v = tl.load(v_cache_ptr + offsets)
    else:
        kv_mask = (dims < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0)
    k = k.to(q.dtype)  # widens an fp8 tile (q is then fp16 or fp32: query_for_cache); no-op otherwise
    v = v.to(q.dtype)

    scores = tile_dot(q, tl.trans(k), DOT_PRECISION) * scale_log2
    if MASKED:
        scores = tl.where(positions[None, :] <= q_pos[:, None], scores, float("-inf"))
    # Every row has seen at least one finite score by now (tiles run in increasing order from a
    # position every row may see), so m_new is finite and alpha never computes inf - inf.
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, DOT_PRECISION)
    return acc, m_new, l_i


def dot_precision(q: torch.Tensor, exact_rows: bool = False) -> str:
    """The kernels' DOT_PRECISION for queries `q`: "ieee" for fp32 (exact fp32 products, no TF32 rounding), "tf32"
    for bf16/fp16 (which ignore it). With `exact_rows` (deterministic mode), "rows" for CPU tensors, which the
    Triton interpreter runs: there `tile_dot` sums products in numpy instead of calling numpy's matmul, whose BLAS
    kernels give a row other bits at another position of the tile (OpenBLAS splits a tile's rows over its
    micro-kernels). Only where bits are compared: it is many times slower than the matmul."""
    if exact_rows and q.device.type == "cpu":
        return "rows"
    return "ieee" if q.dtype == torch.float32 else "tf32"


@triton.jit
def tile_dot(a, b, DOT_PRECISION: tl.constexpr):
    """`a @ b` in float32 (`[M, K] x [K, N]`); DOT_PRECISION as `dot_precision` returns it ("rows" is also what
    `gpu_kernels/batch_invariant.py`'s matmul uses under the interpreter)."""
    if DOT_PRECISION == "rows":
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


def check_paged_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Validate shapes and dtypes shared by prefill and decode; return `out` (allocated if None).

    The caches hold q's dtype, or float8 e4m3fn with scales `k_scale` and `v_scale` (both 1.0
    otherwise).

    Raises:
        ValueError: on any mismatch. Only shapes, strides and dtypes are inspected, never tensor
            values, so the check costs no device-to-host sync.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, num_q_heads, head_dim], got {tuple(q.shape)}")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be equal "
                         "[num_blocks, block_size, num_kv_heads, head_dim] shapes")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} differs from q head_dim {head_dim}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, FP8_KV_DTYPE):
        raise ValueError(f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype} (the "
                         f"caches hold q's dtype or {FP8_KV_DTYPE})")
    check_kv_scales(k_cache.dtype == FP8_KV_DTYPE, k_scale, v_scale)
    if q.stride(-1) != 1:
        raise ValueError("q must have stride 1 in its last dimension")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32 [num_seqs, max_blocks_per_seq], got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables must have stride 1 in its last dimension")
    if seq_lens.shape != (block_tables.shape[0],) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [{block_tables.shape[0]}], got "
                         f"{seq_lens.dtype} {tuple(seq_lens.shape)}")
    if out is None:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} with last-dimension stride 1, got "
                         f"{out.dtype} {tuple(out.shape)}")
    return out
