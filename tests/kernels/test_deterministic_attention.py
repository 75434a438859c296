"""Deterministic mode's attention (gpu_kernels/deterministic_attention.py) under the Triton interpreter: right against
a float64 reference, and bitwise the same for a query in any prefill chunk, in decode, beside any neighbours, and
in place or split-parallel. Contexts reach past several SPLIT_TOKENS splits. The caches and block tables are
poisoned as in tests/kernels/test_paged_attention.py (NaN in unused slots, bad ids in unused table entries)."""

import itertools

import pytest
import torch

pytest.importorskip("triton")

from gpu_kernels.deterministic_attention import SPLIT_TOKENS, choose_parallel, deterministic_attention  # noqa: E402
from tests.kernels.test_paged_attention import i32, make_paged_kv, reference_attention, relative_error  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 16, 16
SCALE = HEAD_DIM**-0.5


def _attend(q, kv, q_lens, seq_lens, parallel=None):
    starts = i32([0, *itertools.accumulate(q_lens)])
    return deterministic_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, starts, i32(seq_lens), max(q_lens),
                                   SCALE, parallel=parallel)


@pytest.mark.parametrize("parallel", [False, True])
def test_matches_the_float64_reference_across_several_splits(parallel: bool) -> None:
    torch.manual_seed(0)
    seq_lens = [1, SPLIT_TOKENS, SPLIT_TOKENS + 1, 2 * SPLIT_TOKENS + 37]
    q_lens = [1] * len(seq_lens) if parallel else [1, 5, SPLIT_TOKENS + 1, 70]
    kv = make_paged_kv(seq_lens, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    q = torch.randn(sum(q_lens), NUM_Q_HEADS, HEAD_DIM)
    out = _attend(q, kv, q_lens, seq_lens, parallel)
    ref = reference_attention(q, kv.keys, kv.values, q_lens, SCALE)
    assert relative_error(out, ref) < 1e-5


def test_a_query_gets_the_same_bits_in_any_chunk_in_decode_and_split_parallel() -> None:
    """The last 12 queries of a sequence of 2 splits and a bit, computed in one prefill, in chunks of 5 and of 1
    (decode rows) beside neighbours of random lengths, in place and split-parallel: bitwise equal (fp32, where a
    changed order shows)."""
    generator = torch.Generator().manual_seed(34)
    seq_len, last_queries = 2 * SPLIT_TOKENS + 9, 12
    kv = make_paged_kv([seq_len, seq_len, seq_len], BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, spare_table_entries=0)
    q_all = torch.randn(seq_len, NUM_Q_HEADS, HEAD_DIM, generator=generator)

    def attend(first: int, last: int, neighbours: list[int], parallel: bool | None = None) -> torch.Tensor:
        """Queries first..last-1 of sequence 0 after neighbours (KV lengths, one query each) over sequences 1-2."""
        tables = torch.stack([kv.block_tables[1 + i % 2] for i in range(len(neighbours))] + [kv.block_tables[0]])
        q = torch.cat([torch.randn(len(neighbours), NUM_Q_HEADS, HEAD_DIM, generator=generator), q_all[first:last]])
        q_lens = [1] * len(neighbours) + [last - first]
        starts = i32([0, *itertools.accumulate(q_lens)])
        out = deterministic_attention(q, kv.k_cache, kv.v_cache, tables, starts, i32(neighbours + [last]),
                                      max(q_lens), SCALE, parallel=parallel)
        return out[len(neighbours):]

    start = seq_len - last_queries
    whole = attend(start, seq_len, [])
    for chunk, parallel in ((5, False), (1, False), (1, True)):
        for first in range(start, seq_len, chunk):
            last = min(first + chunk, seq_len)
            neighbours = [int(n) for n in torch.randint(1, seq_len, (2,), generator=generator)]
            part = attend(first, last, neighbours, parallel)
            assert torch.equal(part, whole[first - start:last - start]), \
                f"chunk {chunk}, parallel {parallel}, queries {first}..{last - 1}"


@pytest.mark.parametrize("parallel", [False, True])
def test_padding_rows_give_zeros_and_read_nothing(parallel: bool) -> None:
    kv = make_paged_kv([40, 0], BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    q = torch.randn(2, NUM_Q_HEADS, HEAD_DIM)
    out = _attend(q, kv, [1, 1], [40, 0], parallel)
    assert torch.isfinite(out).all() and not out[1].any()


def test_split_parallel_takes_decode_rows_only_and_is_chosen_for_small_decode_steps() -> None:
    kv = make_paged_kv([10], BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="decode rows only"):
        _attend(torch.randn(2, NUM_Q_HEADS, HEAD_DIM), kv, [2], [10], parallel=True)
    assert choose_parallel(1, 1, 8, 16, 128, 4096)
    assert not choose_parallel(1, 2, 8, 16, 128, 4096)  # a prefill chunk
    assert not choose_parallel(256, 1, 8, 16, 128, 4096)  # enough programs in place
    assert not choose_parallel(16, 1, 8, 64, 128, 1 << 22)  # split states too large


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels at the real size: needs a CUDA GPU")
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_compiled_kernels_give_a_query_the_same_bits_in_every_step_shape(cache_dtype: torch.dtype) -> None:
    """Qwen3-0.6B's attention shape in bf16 (16 query heads, 8 KV heads, head_dim 128, 16-token blocks): the last 24
    queries of a 700-token sequence computed in one prefill, in chunks of 7, and as decode rows in place (among 255
    neighbours, as a large batch runs) and split-parallel (among 3): bitwise equal; and close to float64."""
    torch.manual_seed(34)
    num_q_heads, num_kv_heads, head_dim, block_size, seq_len, last_queries = 16, 8, 128, 16, 700, 24
    kv = make_paged_kv([seq_len] * 4, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda",
                       spare_table_entries=0)
    k_cache, v_cache = kv.k_cache.to(cache_dtype), kv.v_cache.to(cache_dtype)
    q_all = torch.randn(seq_len, num_q_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    scale = head_dim**-0.5

    def attend(first: int, last: int, neighbours: int, parallel: bool | None) -> torch.Tensor:
        lens = torch.randint(1, seq_len, (neighbours,)).tolist() + [last]
        q_lens = [1] * neighbours + [last - first]
        tables = torch.stack([kv.block_tables[1 + i % 3] for i in range(neighbours)] + [kv.block_tables[0]])
        q = torch.cat([torch.randn(neighbours, num_q_heads, head_dim, dtype=torch.bfloat16, device="cuda"),
                       q_all[first:last]])
        starts = i32([0, *itertools.accumulate(q_lens)]).cuda()
        out = deterministic_attention(q, k_cache, v_cache, tables, starts, i32(lens).cuda(), max(q_lens), scale,
                                      parallel=parallel)
        return out[neighbours:]

    start = seq_len - last_queries
    whole = attend(start, seq_len, 0, False)
    if cache_dtype == torch.bfloat16:
        ref = reference_attention(q_all, [kv.keys[0]], [kv.values[0]], [seq_len], scale)[start:]
        assert relative_error(whole, ref) < 1e-2
    for chunk, neighbours, parallel in ((7, 5, False), (1, 255, False), (1, 3, True)):
        for first in range(start, seq_len, chunk):
            last = min(first + chunk, seq_len)
            part = attend(first, last, neighbours, parallel)
            assert torch.equal(part, whole[first - start:last - start]), \
                f"chunk {chunk}, {neighbours} neighbours, parallel {parallel}, queries {first}..{last - 1}"
