"""store_kvcache writes each token's key and value into its slot and nothing else.

Runs under the Triton interpreter on CPU when there is no GPU (see conftest.py).
"""

import pytest
import torch

pytest.importorskip("triton")

from gpu_kernels import store_kvcache  # noqa: E402


def nan_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    return torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))


def assert_stored_exactly(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """`cache` holds `rows` at the non-negative `slots` and is NaN everywhere else."""
    flat = cache.view(-1, *cache.shape[2:])
    kept = slots >= 0
    assert torch.equal(flat[slots[kept].long()], rows[kept])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots[kept].long()] = False
    assert flat[untouched].isnan().all()


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("block_size", "num_kv_heads", "head_dim"), [(16, 2, 64), (1, 3, 96), (48, 1, 128)])
def test_store_writes_each_token_to_its_slot(
    slot_dtype: torch.dtype, block_size: int, num_kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(block_size * head_dim)
    num_blocks, num_tokens = 5, 37
    k_cache = nan_cache(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = nan_cache(num_blocks, block_size, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens].to(slot_dtype)
    key = torch.randn(slots.numel(), num_kv_heads, head_dim)
    value = torch.randn(slots.numel(), num_kv_heads, head_dim)

    store_kvcache(key, value, k_cache, v_cache, slots)

    assert_stored_exactly(k_cache, slots, key)
    assert_stored_exactly(v_cache, slots, value)


def test_store_skips_padding_slots() -> None:
    torch.manual_seed(1)
    k_cache = nan_cache(4, 16, 2, 64)
    v_cache = nan_cache(4, 16, 2, 64)
    slots = torch.tensor([5, -1, 17, -1, -1, 63, 0], dtype=torch.int32)
    key = torch.randn(7, 2, 64)
    value = torch.randn(7, 2, 64)

    store_kvcache(key, value, k_cache, v_cache, slots)

    assert_stored_exactly(k_cache, slots, key)
    assert_stored_exactly(v_cache, slots, value)


def test_store_reads_strided_views_of_a_fused_qkv_output() -> None:
    torch.manual_seed(2)
    num_tokens, num_q_heads, num_kv_heads, head_dim = 9, 4, 2, 64
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    key = qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, q_size + kv_size:].view(num_tokens, num_kv_heads, head_dim)
    assert not key.is_contiguous()
    k_cache = nan_cache(2, 16, num_kv_heads, head_dim)
    v_cache = nan_cache(2, 16, num_kv_heads, head_dim)
    slots = torch.tensor([31, 0, 1, 2, 16, 17, 30, -1, 8])

    store_kvcache(key, value, k_cache, v_cache, slots)

    assert_stored_exactly(k_cache, slots, key.contiguous())
    assert_stored_exactly(v_cache, slots, value.contiguous())


def test_store_of_zero_tokens_changes_nothing() -> None:
    k_cache = nan_cache(1, 16, 2, 64)
    v_cache = nan_cache(1, 16, 2, 64)
    nothing = torch.empty(0, 2, 64)
    store_kvcache(nothing, nothing, k_cache, v_cache, torch.empty(0, dtype=torch.int64))
    assert k_cache.isnan().all() and v_cache.isnan().all()


def test_store_rejects_inconsistent_arguments() -> None:
    key = torch.randn(3, 2, 64)
    cache = torch.zeros(2, 16, 2, 64)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="dtype"):
        store_kvcache(key.double(), key.double(), cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="contiguous"):
        store_kvcache(key, key, cache.transpose(0, 1), cache.clone(), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kvcache(key, key, cache, cache.clone(), slots[:2])
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kvcache(key, key, cache, cache.clone(), slots.float())
    with pytest.raises(ValueError, match="k_cache"):
        store_kvcache(key, key, torch.zeros(2, 16, 4, 64), cache.clone(), slots)
