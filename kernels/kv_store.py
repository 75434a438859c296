"""Writing this step's keys and values into the paged KV cache.

The cache layout is FlashAttention's paged layout, shared with `kernels/paged_prefill.py` and
`kernels/paged_decode.py`: `k_cache` and `v_cache` are `[num_blocks, block_size, num_kv_heads,
head_dim]`, contiguous, so slot `s = block_id * block_size + offset` is the row
`k_cache.view(-1, num_kv_heads, head_dim)[s]`.
"""

import torch
import triton
import triton.language as tl


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
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
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
    cache_offsets = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(k_cache_ptr + cache_offsets, key, mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value, mask=mask)


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> None:
    """Raise `ValueError` unless both caches are contiguous `[num_blocks, block_size, num_kv_heads,
    head_dim]` tensors of `dtype` and the same shape."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or tuple(cache.shape[2:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name} {tuple(cache.shape)} must be [num_blocks, block_size, {num_kv_heads}, "
                             f"{head_dim}]")
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if cache.dtype != dtype:
            raise ValueError(f"{name} dtype {cache.dtype} differs from the model's {dtype}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy each token's key and value into its slot of the paged KV cache, in place.

    Args:
        key, value: `[num_tokens, num_kv_heads, head_dim]`, same dtype as the cache. Any strides
            on the first two dimensions (e.g. views into a fused qkv projection output); the last
            dimension must have stride 1.
        k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous.
        slot_mapping: `[num_tokens]`, int32 or int64. Token `i` is written to flat slot
            `slot_mapping[i] = block_id * block_size + offset_in_block`; a slot of `-1` marks a
            padding token, for which nothing is written.

    Raises:
        ValueError: on mismatched shapes or dtypes, a non-contiguous cache, or a last-dimension
            stride other than 1.

    Reads no tensor value on the host (no device-to-host sync), so it can be captured in a CUDA
    graph. Same contract as nano-vllm's `store_kvcache` and vLLM's `reshape_and_cache_flash`.
    """
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must be equal 3-d shapes")
    num_tokens, num_kv_heads, head_dim = key.shape
    check_kv_cache(k_cache, v_cache, num_kv_heads, head_dim, key.dtype)
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
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
