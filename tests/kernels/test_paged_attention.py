"""Paged prefill and decode attention against a float64 torch reference (Triton interpreter on CPU).

Every case poisons what the kernels must not touch: unused block-table entries hold -1, a huge
block id or the id of an unused block, unused cache slots hold NaN, and the output is NaN before
the call. A read outside a
sequence's own slots or an output element left unwritten then shows up as NaN or as an error.
"""

import itertools
import math
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gpu_kernels import (  # noqa: E402
    choose_num_splits,
    paged_attention_decode,
    paged_attention_prefill,
    paged_decode,  # noqa: E402
    paged_prefill,
    store_kvcache,
)
from gpu_kernels.paged_decode import compile_decode_variants, reachable_num_splits  # noqa: E402

# Unused block-table entries cycle through these; SPARE means "an unused, NaN-filled block".
SPARE = "spare"
POISON_BLOCK_IDS: tuple[int | str, ...] = (-1, 2**30, SPARE)
FP32_RTOL = 1e-4


def i32(values: list[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int32)


@dataclass
class PagedKV:
    """A paged KV cache holding known keys and values, plus the dense copies for the reference."""

    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], NaN where unused
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, poisoned where unused
    keys: list[torch.Tensor]  # per sequence, [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]


def make_paged_kv(
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    spare_blocks: int = 3,
    spare_table_entries: int = 3,
) -> PagedKV:
    """Scatter random keys/values of each sequence over shuffled cache blocks."""
    blocks_needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    free_blocks = torch.randperm(num_blocks).tolist()
    spare_block = free_blocks.pop(0)  # handed to no sequence
    width = max(blocks_needed, default=0) + spare_table_entries
    poison = [spare_block if entry == SPARE else entry for entry in POISON_BLOCK_IDS] * width
    block_tables = i32(poison[:width]).repeat(len(seq_lens), 1)
    keys, values = [], []
    for b, (seq_len, count) in enumerate(zip(seq_lens, blocks_needed, strict=True)):
        owned = [free_blocks.pop() for _ in range(count)]
        block_tables[b, :count] = i32(owned)
        positions = torch.arange(seq_len)
        block_ids = torch.tensor(owned, dtype=torch.long)[positions // block_size]
        slots = block_ids * block_size + positions % block_size
        key = torch.randn(seq_len, num_kv_heads, head_dim, dtype=dtype, device=device)
        value = torch.randn(seq_len, num_kv_heads, head_dim, dtype=dtype, device=device)
        k_cache.view(-1, num_kv_heads, head_dim)[slots.to(device)] = key
        v_cache.view(-1, num_kv_heads, head_dim)[slots.to(device)] = value
        keys.append(key)
        values.append(value)
    return PagedKV(k_cache, v_cache, block_tables.to(device), keys, values)


def reference_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], q_lens: list[int], scale: float,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Causal attention of each sequence's last q_len positions; a sequence with no keys gives zeros."""
    num_q_heads = q.shape[1]
    outputs = []
    start = 0
    for key, value, q_len in zip(keys, values, q_lens, strict=True):
        q_seq = q[start:start + q_len].to(compute_dtype)
        start += q_len
        seq_len = key.shape[0]
        if seq_len == 0:
            outputs.append(torch.zeros_like(q_seq))
            continue
        group = num_q_heads // key.shape[1]
        k = key.to(compute_dtype).repeat_interleave(group, dim=1)
        v = value.to(compute_dtype).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_seq, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outputs)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.to(ref.dtype) - ref).norm()
    return (diff / ref.norm().clamp_min(1e-30)).item()


def prefill(q: torch.Tensor, kv: PagedKV, q_lens: list[int], seq_lens: list[int], scale: float,
            out: torch.Tensor | None = None) -> torch.Tensor:
    query_start_loc = i32([0, *itertools.accumulate(q_lens)])
    return paged_attention_prefill(q, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, i32(seq_lens),
                                   max(q_lens), scale, out=out)


def decode(q: torch.Tensor, kv: PagedKV, seq_lens: list[int], scale: float, out: torch.Tensor | None = None,
           num_splits: int | None = None, launch_config: tuple[int, int, int] | None = None,
           inline_combine: bool | None = None) -> torch.Tensor:
    return paged_attention_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, i32(seq_lens), scale, out=out,
                                  num_splits=num_splits, launch_config=launch_config, inline_combine=inline_combine)


def run_prefill(q_lens: list[int], seq_lens: list[int], block_size: int, num_q_heads: int, num_kv_heads: int,
                head_dim: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill into a NaN-poisoned output; returns (out, float64 reference)."""
    torch.manual_seed(seed)
    kv = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    out = prefill(q, kv, q_lens, seq_lens, scale, out=torch.full_like(q, float("nan")))
    return out, reference_attention(q, kv.keys, kv.values, q_lens, scale)


def run_decode(seq_lens: list[int], block_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
               seed: int, num_splits: int | None, dtype: torch.dtype = torch.float32,
               launch_config: tuple[int, int, int] | None = None,
               inline_combine: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode into a NaN-poisoned output; padding rows get NaN queries. Returns (out, reference)."""
    torch.manual_seed(seed)
    kv = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, dtype=dtype)
    q[torch.tensor(seq_lens) == 0] = float("nan")
    scale = head_dim**-0.5
    out = decode(q, kv, seq_lens, scale, out=torch.full_like(q, float("nan")), num_splits=num_splits,
                 launch_config=launch_config, inline_combine=inline_combine)
    return out, reference_attention(q, kv.keys, kv.values, [1] * len(seq_lens), scale)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, rtol: float = FP32_RTOL) -> None:
    nan_count = out.isnan().sum().item()
    assert nan_count == 0, f"{nan_count} output elements NaN: unwritten, or read from a poisoned slot"
    assert relative_error(out, ref) < rtol


@pytest.mark.parametrize("block_size", [1, 16, 32, 48, 256])
def test_prefill_with_prefix_hits_and_decode_rows_matches_reference(block_size: int) -> None:
    # Rows: fresh prompt, prompt after a prefix-cache hit, a decode row, a short fresh prompt.
    q_lens = [70, 23, 1, 5]
    seq_lens = [70, 150, 97, 5]
    out, ref = run_prefill(q_lens, seq_lens, block_size, 4, 2, 64, seed=block_size)
    assert_matches(out, ref)


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(2, 2), (6, 2), (4, 1), (8, 1)])
def test_prefill_grouped_query_heads_match_reference(num_q_heads: int, num_kv_heads: int) -> None:
    out, ref = run_prefill([40, 1, 17], [90, 33, 17], 16, num_q_heads, num_kv_heads, 64,
                           seed=10 * num_q_heads + num_kv_heads)
    assert_matches(out, ref)


@pytest.mark.parametrize("head_dim", [96, 128])
def test_prefill_other_head_dims_match_reference(head_dim: int) -> None:
    out, ref = run_prefill([9, 30], [40, 30], 16, 4, 2, head_dim, seed=head_dim)
    assert_matches(out, ref)


def test_chunked_prefill_matches_single_pass() -> None:
    torch.manual_seed(7)
    prompt_len, chunks = 130, [50, 64, 16]
    kv = make_paged_kv([prompt_len], 16, 2, 64)
    q = torch.randn(prompt_len, 4, 64)
    whole = prefill(q, kv, [prompt_len], [prompt_len], 0.125)
    pieces = []
    done = 0
    for chunk in chunks:
        pieces.append(prefill(q[done:done + chunk], kv, [chunk], [done + chunk], 0.125))
        done += chunk
    ref = reference_attention(q, kv.keys, kv.values, [prompt_len], 0.125)
    assert_matches(torch.cat(pieces), ref)
    assert_matches(whole, ref)


def test_prefill_reads_nothing_past_the_chunk_end() -> None:
    # The chunk ends at position 60 of a 100-token sequence whose later slots hold NaN.
    torch.manual_seed(8)
    kv = make_paged_kv([100], 16, 2, 64)
    later = torch.arange(60, 100)
    later_slots = kv.block_tables[0].long()[later // 16] * 16 + later % 16
    kv.k_cache.view(-1, 2, 64)[later_slots] = float("nan")
    kv.v_cache.view(-1, 2, 64)[later_slots] = float("nan")
    q = torch.randn(20, 4, 64)
    out = prefill(q, kv, [20], [60], 0.125)
    assert_matches(out, reference_attention(q, [kv.keys[0][:60]], [kv.values[0][:60]], [20], 0.125))


def test_prefill_reads_q_through_strides_of_a_fused_qkv_view() -> None:
    torch.manual_seed(9)
    kv = make_paged_kv([40], 16, 2, 64)
    qkv = torch.randn(40, (4 + 2 + 2) * 64)
    q = qkv[:, : 4 * 64].view(40, 4, 64)
    out = prefill(q, kv, [40], [40], 0.125)
    assert_matches(out, reference_attention(q, kv.keys, kv.values, [40], 0.125))


def test_small_tiles_match_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    # 16x16 tiles put many tile edges inside each sequence, block and query range.
    monkeypatch.setattr(paged_prefill, "_prefill_launch_config", lambda group, head_dim: (16, 16, 4, 1))
    out, ref = run_prefill([45, 1, 16, 17], [45, 70, 48, 33], 48, 6, 2, 32, seed=13)
    assert_matches(out, ref)
    out, ref = run_decode([45, 0, 16, 17, 100], 16, 6, 2, 32, seed=14, num_splits=4, launch_config=(16, 4, 1))
    assert_matches(out, ref)


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    block_size=st.sampled_from([1, 16, 32, 48, 256]),
    heads=st.sampled_from([(2, 2), (6, 2), (8, 2), (8, 1)]),
    rows=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 80)), min_size=1, max_size=4),
)
def test_prefill_random_batches_match_reference(
    seed: int, block_size: int, heads: tuple[int, int], rows: list[tuple[int, int]]
) -> None:
    q_lens = [q_len for q_len, _ in rows]
    seq_lens = [q_len + cached for q_len, cached in rows]
    out, ref = run_prefill(q_lens, seq_lens, block_size, heads[0], heads[1], 32, seed)
    assert_matches(out, ref)


@pytest.mark.parametrize("block_size", [1, 16, 32, 48, 256])
@pytest.mark.parametrize(("num_splits", "inline_combine"), [(1, False), (4, False), (4, True)])
def test_decode_matches_reference(block_size: int, num_splits: int, inline_combine: bool) -> None:
    out, ref = run_decode([1, 64, 65, 200, 17], block_size, 8, 2, 64, seed=block_size + num_splits,
                          num_splits=num_splits, inline_combine=inline_combine)
    assert_matches(out, ref)


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(2, 2), (6, 2), (4, 1), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 96])
@pytest.mark.parametrize("inline_combine", [False, True])
def test_decode_grouped_query_heads_and_head_dims_match_reference(
    num_q_heads: int, num_kv_heads: int, head_dim: int, inline_combine: bool
) -> None:
    out, ref = run_decode([3, 130, 40], 16, num_q_heads, num_kv_heads, head_dim,
                          seed=num_q_heads * 100 + head_dim, num_splits=2, inline_combine=inline_combine)
    assert_matches(out, ref)


@pytest.mark.parametrize("num_splits", [1, 2, 16])
@pytest.mark.parametrize("inline_combine", [False, True])
def test_decode_padding_rows_write_zeros_and_read_nothing(num_splits: int, inline_combine: bool) -> None:
    # Padding rows have NaN queries and block-table rows of poison only.
    seq_lens = [0, 50, 0, 0, 129]
    out, ref = run_decode(seq_lens, 16, 4, 2, 64, seed=num_splits, num_splits=num_splits,
                          inline_combine=inline_combine)
    assert torch.equal(out[[0, 2, 3]], torch.zeros_like(out[[0, 2, 3]]))
    assert_matches(out, ref)


@pytest.mark.parametrize("inline_combine", [False, True])
def test_decode_split_counts_agree(inline_combine: bool) -> None:
    # 16 splits of a 20-token sequence leaves most splits empty; they must weigh nothing.
    seq_lens = [20, 300, 129, 64]
    outputs = [run_decode(seq_lens, 32, 4, 2, 64, seed=3, num_splits=n, inline_combine=inline_combine)[0]
               for n in (1, 2, 8, 16)]
    for other in outputs[1:]:
        assert relative_error(other, outputs[0].double()) < 1e-5


def test_decode_combines_its_splits_inline_with_the_counters_left_zero_and_the_same_bits_every_call() -> None:
    """The last split program of each (sequence, KV head) combines the splits (gpu_kernels/split_counters.py): every
    call finds the counters as the last one left them, so the same inputs give the same bits, also after a launch
    with other sequence lengths."""
    from gpu_kernels import split_counters

    first = run_decode([20, 300, 0, 64], 16, 4, 2, 64, seed=5, num_splits=8, inline_combine=True)[0]
    run_decode([7, 1, 99, 250], 16, 4, 2, 64, seed=6, num_splits=8, inline_combine=True)
    again = run_decode([20, 300, 0, 64], 16, 4, 2, 64, seed=5, num_splits=8, inline_combine=True)[0]
    assert torch.equal(first, again)
    assert not split_counters._counters[first.device].any()


@pytest.mark.parametrize("launch_config", [(32, 2, 1), (64, 4, 3), (128, 4, 2), (128, 8, 4)])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_every_tile_size_matches_reference(launch_config: tuple[int, int, int], num_splits: int) -> None:
    # Lengths around the 32-, 64- and 128-key tile edges, and a padding row.
    out, ref = run_decode([1, 31, 64, 129, 0, 300], 16, 4, 2, 64, seed=sum(launch_config) + num_splits,
                          num_splits=num_splits, launch_config=launch_config)
    assert_matches(out, ref)


def test_decode_default_split_count_matches_reference() -> None:
    out, ref = run_decode([5, 333], 16, 4, 2, 64, seed=11, num_splits=None)
    assert_matches(out, ref)


def test_choose_num_splits_fills_the_gpu_only_when_the_batch_is_small() -> None:
    assert choose_num_splits(256, 8, 256, 16) == 1
    assert choose_num_splits(8, 8, 256, 16) == 8
    assert choose_num_splits(1, 1, 10_000, 16) == 16
    # A block table holding at most 512 tokens allows two splits of 256.
    assert choose_num_splits(1, 1, 32, 16) == 2
    assert choose_num_splits(0, 8, 0, 16) == 1
    for num_seqs in range(1, 70):
        splits = choose_num_splits(num_seqs, 4, 128, 16)
        assert splits & (splits - 1) == 0


def test_half_precision_inputs_match_reference() -> None:
    # fp16 stands in for the GPU's bf16: the Triton interpreter's tl.dot mishandles bf16 operands.
    out, ref = run_prefill([30, 1], [50, 20], 16, 4, 2, 64, seed=15, dtype=torch.float16)
    assert out.dtype == torch.float16
    assert_matches(out, ref, rtol=2e-3)
    out, ref = run_decode([50, 0, 20], 16, 4, 2, 64, seed=16, num_splits=2, dtype=torch.float16)
    assert out.dtype == torch.float16
    assert_matches(out, ref, rtol=2e-3)


def test_store_then_prefill_then_decode_match_reference() -> None:
    torch.manual_seed(12)
    num_kv_heads, head_dim, block_size, prompt_len = 2, 32, 16, 37
    k_cache = torch.full((8, block_size, num_kv_heads, head_dim), float("nan"))
    kv = PagedKV(k_cache, k_cache.clone(), i32([[5, 2, 7, -1]]), [], [])
    positions = torch.arange(prompt_len + 1)
    slots = kv.block_tables[0].long()[positions // block_size] * block_size + positions % block_size
    q = torch.randn(prompt_len + 1, 4, head_dim)
    key = torch.randn(prompt_len + 1, num_kv_heads, head_dim)
    value = torch.randn(prompt_len + 1, num_kv_heads, head_dim)
    scale = head_dim**-0.5

    store_kvcache(key[:prompt_len], value[:prompt_len], kv.k_cache, kv.v_cache, slots[:prompt_len])
    prefill_out = prefill(q[:prompt_len], kv, [prompt_len], [prompt_len], scale)
    store_kvcache(key[prompt_len:], value[prompt_len:], kv.k_cache, kv.v_cache, slots[prompt_len:])
    decode_out = decode(q[prompt_len:], kv, [prompt_len + 1], scale, num_splits=2)

    ref = reference_attention(q, [key], [value], [prompt_len + 1], scale)
    assert_matches(prefill_out, ref[:prompt_len])
    assert_matches(decode_out, ref[prompt_len:])


def test_attention_rejects_inconsistent_arguments() -> None:
    kv = make_paged_kv([4], 16, 2, 64)
    seq_lens = i32([4])
    q = torch.randn(1, 4, 64)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention_decode(q.double(), kv.k_cache, kv.v_cache, kv.block_tables, seq_lens, 0.1)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_decode(torch.randn(1, 3, 64), kv.k_cache, kv.v_cache, kv.block_tables, seq_lens, 0.1)
    with pytest.raises(ValueError, match="power of two"):
        paged_attention_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, seq_lens, 0.1, num_splits=3)
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention_decode(q, kv.k_cache, kv.v_cache, kv.block_tables.long(), seq_lens, 0.1)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_prefill(q, kv.k_cache, kv.v_cache, kv.block_tables, torch.tensor([0, 1]), seq_lens,
                                1, 0.1)


@pytest.mark.parametrize(("max_num_seqs", "num_kv_heads", "max_blocks", "block_size"),
                         [(100, 8, 256, 16), (256, 8, 2560, 16), (8, 2, 3, 16), (1, 1, 1, 16), (64, 4, 40, 256)])
def test_the_warm_up_list_holds_every_split_count_a_step_can_pick(max_num_seqs: int, num_kv_heads: int,
                                                                  max_blocks: int, block_size: int) -> None:
    picked = {choose_num_splits(n, num_kv_heads, w, block_size)
              for n in range(1, max_num_seqs + 1) for w in range(1, max_blocks + 1)}

    assert reachable_num_splits(max_num_seqs, num_kv_heads, max_blocks, block_size) == sorted(picked)


def test_the_decode_warm_up_runs_every_variant_on_a_padding_row_and_writes_no_cache_entry(
        monkeypatch: pytest.MonkeyPatch) -> None:
    k_cache = torch.randn(4, 16, 2, 32)
    v_cache = torch.randn(4, 16, 2, 32)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    calls: list[int] = []
    original = paged_decode.paged_attention_decode

    def recording(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(kwargs["num_splits"])
        out = original(*args, **kwargs)
        assert not out.any()  # a padding row's output is zero
        return out

    monkeypatch.setattr(paged_decode, "paged_attention_decode", recording)
    compile_decode_variants(torch.randn(1, 4, 32), k_cache, v_cache, [1, 2, 4], 0.125)

    assert calls == [1, 2, 4]
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)
