"""QK-norm, rotary embedding and the KV-cache store fused into one kernel.

Between the fused qkv projection and attention, an unfused step runs per layer: RMSNorm over each
query head and each key head (Qwen3's QK-norm), RoPE on q and k, then the store of k and v into
the paged KV cache -- four launches of a few microseconds each, which at decode cost more than
the arithmetic. This kernel reads the qkv projection output once and does all of it:

- q: RMSNorm (if weights are given), RoPE, written to a new `[T, Hq, D]` tensor for attention;
- k: RMSNorm (if weights are given), RoPE, written into `k_cache` at the token's slot;
- v: copied as it is into `v_cache` at the token's slot.

The rounding points are those of the unfused layers (`workers/layers/norm.py` `rms_norm`, then
`workers/layers/rotary.py` `_rotate`), so results equal theirs bit for bit up to the order of the
mean-square sum: RMSNorm computes `x * rsqrt(mean(x^2) + eps)` in float32, rounds to the model
dtype, multiplies by the weight (float32 product, rounded to the model dtype); RoPE computes
`[x1*cos - x2*sin, x2*cos + x1*sin]` in float32 and rounds to the model dtype. The kernel is
compiled without floating-point contraction (no fused multiply-add), like eager torch.

The cache layout is that of `gpu_kernels/kv_store.py`: `[num_blocks, block_size, num_kv_heads,
head_dim]`, contiguous, slot `s = block_id * block_size + offset`. An fp8 cache (float8 e4m3fn) gets
`e4m3(x * (1 / scale))` of the values above, rounded as `store_kvcache` rounds them (`gpu_kernels/fp8.py`),
so the fused and the unfused paths store the same bytes. vLLM does the same work with
two kernels: `fused_qk_norm_rope` (norm and rotation in place) and `reshape_and_cache_flash`.
"""

import torch
import triton
import triton.language as tl

from gpu_kernels.fp8 import e4m3_bits
from gpu_kernels.kv_store import check_kv_cache
from gpu_kernels.pdl import launch_options, pdl_for, wait_then_release
from gpu_kernels.rounding import round_to


@triton.jit
def _norm_rotate(x1, x2, weight_ptr, cos, sin, eps, half_dims, dim_mask,
                 HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """RMSNorm (when HAS_NORM) then rotate-half RoPE of a tile of heads.

    x1, x2: `[heads, BLOCK_HALF]` first and second halves of each head, in the model dtype (masked
    lanes hold 0). cos, sin: `[BLOCK_HALF]` float32. Returns the two rotated halves, model dtype.
    """
    dtype = x1.dtype
    if HAS_NORM:
        a1 = x1.to(tl.float32)
        a2 = x2.to(tl.float32)
        mean_square = tl.math.div_rn(tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1), HEAD_DIM)
        inv_rms = tl.math.rsqrt(mean_square + eps)[:, None]
        w1 = tl.load(weight_ptr + half_dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + HEAD_DIM // 2 + half_dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
        # Rounded to the model dtype, then weighted: the product of two 16-bit floats is exact in
        # float32, so this rounds once, like torch's `weight * x.to(dtype)`.
        x1 = round_to(w1 * round_to(a1 * inv_rms, dtype).to(tl.float32), dtype)
        x2 = round_to(w2 * round_to(a2 * inv_rms, dtype).to(tl.float32), dtype)
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    cos = cos[None, :]
    sin = sin[None, :]
    return round_to(f1 * cos - f2 * sin, dtype), round_to(f2 * cos + f1 * sin, dtype)


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr,
    positions_ptr,
    cos_sin_ptr,
    q_norm_weight_ptr,
    k_norm_weight_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_qkv_token,
    stride_cos_sin_position,
    eps,
    inv_k_scale,
    inv_v_scale,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (token, group): groups [0, NUM_Q_GROUPS) take HEADS_PER_PROGRAM query heads each;
    # the groups after them take as many KV heads each (k normed, rotated and stored; v stored).
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    NUM_Q_GROUPS: tl.constexpr = (NUM_HEADS + HEADS_PER_PROGRAM - 1) // HEADS_PER_PROGRAM
    half_dims = tl.arange(0, BLOCK_HALF)
    dim_mask = half_dims < HALF
    rows = tl.arange(0, HEADS_PER_PROGRAM)
    wait_then_release(PDL)  # gpu_kernels/pdl.py
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + position * stride_cos_sin_position + half_dims, mask=dim_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + position * stride_cos_sin_position + HALF + half_dims, mask=dim_mask, other=0.0)
    qkv_row = qkv_ptr + token * stride_qkv_token
    if group < NUM_Q_GROUPS:
        heads = group * HEADS_PER_PROGRAM + rows
        mask = (heads < NUM_HEADS)[:, None] & dim_mask[None, :]
        offsets = heads[:, None] * HEAD_DIM + half_dims[None, :]  # within the q part of a row
        x1 = tl.load(qkv_row + offsets, mask=mask, other=0.0)
        x2 = tl.load(qkv_row + offsets + HALF, mask=mask, other=0.0)
        y1, y2 = _norm_rotate(x1, x2, q_norm_weight_ptr, cos, sin, eps, half_dims, dim_mask, HEAD_DIM, HAS_NORM)
        out = q_out_ptr + token * (NUM_HEADS * HEAD_DIM) + offsets
        tl.store(out, y1, mask=mask)
        tl.store(out + HALF, y2, mask=mask)
    else:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:  # -1: a padding token, whose k/v must not be stored
            heads = (group - NUM_Q_GROUPS) * HEADS_PER_PROGRAM + rows
            mask = (heads < NUM_KV_HEADS)[:, None] & dim_mask[None, :]
            offsets = heads[:, None] * HEAD_DIM + half_dims[None, :]  # within the k (or v) part of a row
            k_row = qkv_row + NUM_HEADS * HEAD_DIM
            v_row = k_row + NUM_KV_HEADS * HEAD_DIM
            x1 = tl.load(k_row + offsets, mask=mask, other=0.0)
            x2 = tl.load(k_row + offsets + HALF, mask=mask, other=0.0)
            y1, y2 = _norm_rotate(x1, x2, k_norm_weight_ptr, cos, sin, eps, half_dims, dim_mask, HEAD_DIM, HAS_NORM)
            v1 = tl.load(v_row + offsets, mask=mask)
            v2 = tl.load(v_row + offsets + HALF, mask=mask)
            if FP8:  # the caches are uint8 views of the e4m3fn tensors
                y1 = e4m3_bits(y1.to(tl.float32) * inv_k_scale)
                y2 = e4m3_bits(y2.to(tl.float32) * inv_k_scale)
                v1 = e4m3_bits(v1.to(tl.float32) * inv_v_scale)
                v2 = e4m3_bits(v2.to(tl.float32) * inv_v_scale)
            cache_offsets = slot * (NUM_KV_HEADS * HEAD_DIM) + offsets
            tl.store(k_cache_ptr + cache_offsets, y1, mask=mask)
            tl.store(k_cache_ptr + cache_offsets + HALF, y2, mask=mask)
            tl.store(v_cache_ptr + cache_offsets, v1, mask=mask)
            tl.store(v_cache_ptr + cache_offsets + HALF, v2, mask=mask)


_MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


def qk_norm_rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    heads_per_program: int | None = None,
) -> torch.Tensor:
    """Normalise and rotate q and k, store k and v in the paged KV cache, return q; one launch.

    Equal to the unfused layers `q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, ...)`,
    `q, k = apply_rotary(positions, q, k, cos_sin_cache)`, `store_kvcache(k, v, ...)` (see the
    module docstring for the rounding). T tokens; Hq, Hk, D = num_heads, num_kv_heads, head_dim,
    the counts local to this tensor-parallel rank.

    Args:
        qkv: `[T, (Hq + 2*Hk) * D]` float16, bfloat16 or float32, the fused projection output
            (q heads, then k heads, then v heads); the last dimension must have stride 1.
        positions: `[T]` int32/int64, each token's position; must be below `cos_sin_cache.shape[0]`
            (not checked: checking would read the tensor on the host).
        cos_sin_cache: `[max_position, D]` float32, contiguous: `cat(cos * scaling, sin * scaling)`
            per position, the rotate-half layout of `workers/layers/rotary.py`.
        q_norm_weight, k_norm_weight: `[D]` in qkv's dtype (Qwen3's QK-norm), or both None for
            RoPE only (Llama).
        eps: the RMSNorm epsilon.
        k_cache, v_cache: `[num_blocks, block_size, Hk, D]`, contiguous, qkv's dtype or float8 e4m3fn;
            written in place.
        slot_mapping: `[T]` int32/int64; token i's k/v go to flat slot `slot_mapping[i]`, and a
            slot of -1 (padding) stores nothing.
        num_heads, num_kv_heads, head_dim: Hq, Hk and D; D must be even (any even D is handled
            with masks, not only powers of two).
        k_scale, v_scale: an fp8 cache's scales (see `store_kvcache`); 1.0 for a cache in qkv's dtype.
        heads_per_program: heads one program handles (tests; None chooses for the device).

    Returns:
        q `[T, Hq, D]`, a new contiguous tensor in qkv's dtype, normalised and rotated.

    Raises:
        ValueError: on mismatched shapes, dtypes or devices, a non-contiguous cache or table,
            an odd head_dim, only one of the two norm weights, or a scale that is not positive and
            finite (or not 1.0 where the cache is not fp8).

    Reads no tensor value on the host, so it can be captured in a CUDA graph.
    """
    if num_heads <= 0 or num_kv_heads <= 0 or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"num_heads {num_heads} and num_kv_heads {num_kv_heads} must be positive and head_dim "
                         f"{head_dim} positive and even (rotate-half RoPE)")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(f"qkv {tuple(qkv.shape)} must be [num_tokens, {width}] = (num_heads {num_heads} + "
                         f"2 * num_kv_heads {num_kv_heads}) * head_dim {head_dim}")
    if qkv.dtype not in _MODEL_DTYPES:
        raise ValueError(f"qkv dtype {qkv.dtype} must be one of {_MODEL_DTYPES}")
    if qkv.stride(1) != 1:
        raise ValueError("qkv must have stride 1 in its last dimension")
    num_tokens = qkv.shape[0]
    for name, index in (("positions", positions), ("slot_mapping", slot_mapping)):
        if index.shape != (num_tokens,) or index.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name} must be int32/int64 of shape ({num_tokens},), got {index.dtype} "
                             f"{tuple(index.shape)}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache {cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)} must be float32 "
                         f"[max_position, {head_dim}]")
    if not cos_sin_cache.is_contiguous():
        raise ValueError("cos_sin_cache must be contiguous")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight must be both given or both None")
    for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if weight is not None and (weight.shape != (head_dim,) or weight.dtype != qkv.dtype
                                   or not weight.is_contiguous()):
            raise ValueError(f"{name} {weight.dtype} {tuple(weight.shape)} must be contiguous {qkv.dtype} "
                             f"[{head_dim}]")
    fp8 = check_kv_cache(k_cache, v_cache, num_kv_heads, head_dim, qkv.dtype, k_scale, v_scale)
    tensors = {"positions": positions, "cos_sin_cache": cos_sin_cache, "k_cache": k_cache, "v_cache": v_cache,
               "slot_mapping": slot_mapping, "q_norm_weight": q_norm_weight, "k_norm_weight": k_norm_weight}
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != qkv.device:
            raise ValueError(f"{name} is on {tensor.device}, qkv on {qkv.device}")

    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    if heads_per_program is None:
        # On a GPU one head per program (one warp), as in vLLM's fused_qk_norm_rope: a decode
        # step of a few tokens still spreads over (Hq + Hk) * T programs. The interpreter runs
        # programs one after another, so there each program takes all heads of its kind.
        heads_per_program = 1 if qkv.is_cuda else max(num_heads, num_kv_heads)
    heads_per_program = triton.next_power_of_2(heads_per_program)
    num_groups = triton.cdiv(num_heads, heads_per_program) + triton.cdiv(num_kv_heads, heads_per_program)
    block_half = triton.next_power_of_2(head_dim // 2)
    pdl = pdl_for(qkv)
    _qk_norm_rope_store_kernel[(num_tokens, num_groups)](
        qkv,
        positions,
        cos_sin_cache,
        q_norm_weight,
        k_norm_weight,
        q,
        k_cache.view(torch.uint8) if fp8 else k_cache,
        v_cache.view(torch.uint8) if fp8 else v_cache,
        slot_mapping,
        qkv.stride(0),
        cos_sin_cache.stride(0),
        eps,
        1.0 / k_scale,
        1.0 / v_scale,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_HALF=block_half,
        HEADS_PER_PROGRAM=heads_per_program,
        HAS_NORM=q_norm_weight is not None,
        FP8=fp8,
        PDL=pdl,
        num_warps=max(1, min(4, heads_per_program * block_half // 64)),
        enable_fp_fusion=False,
        **launch_options(pdl),
    )
    return q
