"""Writing this step's keys and values into the paged KV cache.

The cache layout is FlashAttention's paged layout, shared with `gpu_kernels/paged_prefill.py` and
`gpu_kernels/paged_decode.py`: `k_cache` and `v_cache` are `[num_blocks, block_size, num_kv_heads,
head_dim]`, contiguous, so slot `s = block_id * block_size + offset` is the row
`k_cache.view(-1, num_kv_heads, head_dim)[s]`.

The cache holds the model's dtype, or float8 e4m3fn (the fp8 KV cache, `gpu_kernels/fp8.py`): then each
element is stored as `e4m3(x / scale)`, with one scale for all keys and one for all values of a
layer, and the kernels that read the cache multiply by the scale again.
"""

import math

import torch
import triton
import triton.language as tl

from gpu_kernels.fp8 import e4m3_bits

FP8_KV_DTYPE = torch.float8_e4m3fn


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    inv_k_scale,
    inv_v_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    # One program per token: it copies all KV heads of that token into one cache slot.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    key = tl.load(
        key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :], mask=mask
    )
    value = tl.load(
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :],
        mask=mask,
    )
    if FP8:  # the caches are uint8 views of the e4m3fn tensors
        key = e4m3_bits(key.to(tl.float32) * inv_k_scale)
        value = e4m3_bits(value.to(tl.float32) * inv_v_scale)
    cache_offsets = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(k_cache_ptr + cache_offsets, key, mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value, mask=mask)


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype, k_scale: float = 1.0, v_scale: float = 1.0) -> bool:
    """Raise `ValueError` unless both caches are contiguous `[num_blocks, block_size, num_kv_heads,
    head_dim]` tensors of the same shape, both of `dtype` (the model's) or both float8 e4m3fn, and
    the scales are positive and finite (and 1.0 for a cache of the model's dtype). Returns whether
    the cache is fp8."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or tuple(cache.shape[2:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name} {tuple(cache.shape)} must be [num_blocks, block_size, {num_kv_heads}, "
                             f"{head_dim}]")
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if cache.dtype not in (dtype, FP8_KV_DTYPE):
            raise ValueError(f"{name} dtype {cache.dtype} is neither the model's {dtype} nor {FP8_KV_DTYPE}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype} {tuple(k_cache.shape)} and v_cache {v_cache.dtype} "
                         f"{tuple(v_cache.shape)} differ")
    return check_kv_scales(k_cache.dtype == FP8_KV_DTYPE, k_scale, v_scale)


def check_kv_scales(fp8: bool, k_scale: float, v_scale: float) -> bool:
    """Raise `ValueError` unless both scales are positive finite numbers, equal to 1.0 where the
    cache is not fp8 (nothing would apply them). Returns `fp8`."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (isinstance(scale, (int, float)) and 0 < scale < math.inf):
            raise ValueError(f"{name} must be a positive finite number, got {scale!r}")
        if not fp8 and scale != 1.0:
            raise ValueError(f"{name} is {scale}, but only an fp8 KV cache is scaled (it must be 1.0)")
    return fp8


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Copy each token's key and value into its slot of the paged KV cache, in place.

    Args:
        key, value: `[num_tokens, num_kv_heads, head_dim]`, the model's dtype. Any strides on the
            first two dimensions (e.g. views into a fused qkv projection output); the last
            dimension must have stride 1.
        k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous, in the
            key's dtype (copied as they are) or float8 e4m3fn (each element stored as
            `e4m3(x * (1 / scale))` computed in float32, rounded to nearest even, saturating at
            +-448; see `gpu_kernels/fp8.py`).
        slot_mapping: `[num_tokens]`, int32 or int64. Token `i` is written to flat slot
            `slot_mapping[i] = block_id * block_size + offset_in_block`; a slot of `-1` marks a
            padding token, for which nothing is written.
        k_scale, v_scale: the fp8 cache's dequantization scales; 1.0 for a cache in the model's dtype.

    Raises:
        ValueError: on mismatched shapes or dtypes, a non-contiguous cache, a last-dimension
            stride other than 1, or a scale that is not positive and finite (or not 1.0 where
            the cache is not fp8).

    Reads no tensor value on the host (no device-to-host sync), so it can be captured in a CUDA
    graph. Same contract as nano-vllm's `store_kvcache` and vLLM's `reshape_and_cache_flash`.
    """
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must be equal 3-d shapes")
    num_tokens, num_kv_heads, head_dim = key.shape
    fp8 = check_kv_cache(k_cache, v_cache, num_kv_heads, head_dim, key.dtype, k_scale, v_scale)
    if value.dtype != key.dtype:
        raise ValueError(f"value dtype {value.dtype} differs from key dtype {key.dtype}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must have stride 1 in their last dimension")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 of shape ({num_tokens},), got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache.view(torch.uint8) if fp8 else k_cache,
        v_cache.view(torch.uint8) if fp8 else v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        1.0 / k_scale,
        1.0 / v_scale,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=fp8,
        num_warps=4,
    )
