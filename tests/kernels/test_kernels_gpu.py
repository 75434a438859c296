"""The kernels compiled for a real GPU, in bf16, at Qwen3-0.6B attention shapes.

16 query heads, 8 KV heads, head_dim 128; batches up to 256, contexts up to 4096, block sizes 16
and 256. Outputs are compared with a float64 torch reference at 1e-2 relative error (bf16
inputs, fp32 accumulation). Run with `pytest -m gpu tests/kernels` on a CUDA machine.
"""

import random

import pytest
import torch

pytest.importorskip("triton")

from gpu_kernels import paged_attention_decode, paged_attention_prefill, qk_norm_rope_store, store_kvcache  # noqa: E402

from .test_paged_attention import i32, make_paged_kv, reference_attention, relative_error  # noqa: E402
from .test_rope_kv_store import EPS, assert_matches_unfused, cos_sin_table, make_case, unfused  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
SCALE = HEAD_DIM**-0.5
BF16_RTOL = 1e-2


def assert_close_bf16(out: torch.Tensor, ref: torch.Tensor) -> None:
    nan_count = out.isnan().sum().item()
    assert nan_count == 0, f"{nan_count} output elements NaN: unwritten, or read from a poisoned slot"
    assert relative_error(out, ref) < BF16_RTOL


@pytest.mark.parametrize("block_size", [16, 256])
def test_store_kvcache_bf16_writes_slots_and_skips_padding(block_size: int) -> None:
    torch.manual_seed(block_size)
    num_tokens, num_blocks = 4096, 4096 * 2 // block_size
    qkv_width = (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    qkv = torch.randn(num_tokens, qkv_width, device="cuda", dtype=torch.bfloat16)
    kv = qkv[:, NUM_Q_HEADS * HEAD_DIM:].view(num_tokens, 2, NUM_KV_HEADS, HEAD_DIM)
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]
    slots[::7] = -1
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    v_cache = torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)

    store_kvcache(key, value, k_cache, v_cache, slots.to(torch.int32))

    expected_k = torch.full_like(k_cache, float("nan")).view(-1, NUM_KV_HEADS, HEAD_DIM)
    expected_v = expected_k.clone()
    kept = slots >= 0
    expected_k[slots[kept]] = key[kept]
    expected_v[slots[kept]] = value[kept]
    assert torch.equal(k_cache.view_as(expected_k).nan_to_num(7.0), expected_k.nan_to_num(7.0))
    assert torch.equal(v_cache.view_as(expected_v).nan_to_num(7.0), expected_v.nan_to_num(7.0))


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize(("batch", "max_context"), [(1, 4096), (8, 4096), (256, 2048)])
@pytest.mark.parametrize(("num_splits", "inline_combine"), [(None, False), (None, True), (1, False), (4, False),
                                                          (4, True)])
def test_decode_bf16_matches_reference(
    block_size: int, batch: int, max_context: int, num_splits: int | None, inline_combine: bool
) -> None:
    rng = random.Random(batch * block_size)
    torch.manual_seed(batch * block_size)
    seq_lens = [rng.randint(1, max_context) for _ in range(batch)]
    if batch > 1:
        seq_lens[1] = 0  # a CUDA-graph padding row
    kv = make_paged_kv(seq_lens, block_size, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))

    paged_attention_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, i32(seq_lens).cuda(), SCALE, out=out,
                           num_splits=num_splits, inline_combine=inline_combine)

    assert_close_bf16(out, reference_attention(q, kv.keys, kv.values, [1] * batch, SCALE))
    if batch > 1:
        assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("block_size", [16, 256])
def test_prefill_bf16_mixed_batch_matches_reference(block_size: int) -> None:
    # Fresh prompts, prefix-cache hits, a chunk of a long prompt and decode rows in one batch.
    torch.manual_seed(block_size)
    q_lens = [1024, 700, 1, 512, 1, 37, 2048]
    seq_lens = [1024, 2000, 3000, 4096, 1, 37, 2048]
    kv = make_paged_kv(seq_lens, block_size, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    q = torch.randn(sum(q_lens), NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    query_start_loc = i32([0, *torch.tensor(q_lens).cumsum(0).tolist()]).cuda()

    paged_attention_prefill(q, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, i32(seq_lens).cuda(),
                            max(q_lens), SCALE, out=out)

    assert_close_bf16(out, reference_attention(q, kv.keys, kv.values, q_lens, SCALE))


@pytest.mark.parametrize("inline_combine", [False, True])
def test_decode_replayed_from_a_cuda_graph_matches_eager(inline_combine: bool) -> None:
    torch.manual_seed(0)
    batch, block_size, max_context = 8, 16, 4096
    kv = make_paged_kv([max_context] * batch, block_size, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    seq_lens = i32([1] * batch).cuda()
    out = torch.empty_like(q)

    def step() -> None:
        paged_attention_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, seq_lens, SCALE, out=out,
                               inline_combine=inline_combine)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    rng = random.Random(0)
    for _ in range(3):
        lengths = [rng.randint(0, max_context) for _ in range(batch)]
        seq_lens.copy_(i32(lengths))
        q.copy_(torch.randn_like(q))
        graph.replay()
        replayed = out.clone()
        step()
        assert torch.equal(replayed, out)
        keys = [k[:n] for k, n in zip(kv.keys, lengths, strict=True)]
        values = [v[:n] for v, n in zip(kv.values, lengths, strict=True)]
        assert_close_bf16(replayed, reference_attention(q, keys, values, [1] * batch, SCALE))


@pytest.mark.parametrize("has_norm", [True, False], ids=["qk-norm", "rope-only"])
@pytest.mark.parametrize("block_size", [16, 256])
def test_qk_norm_rope_store_bf16_matches_the_unfused_layers(has_norm: bool, block_size: int) -> None:
    """256 tokens of which every third is padding; eager torch is the reference (bit for bit
    without QK-norm, nearly every element bit-equal with it: see test_rope_kv_store.py)."""
    num_tokens, num_blocks = 256, 1024 // block_size
    qkv, positions, _, q_weight, k_weight, slots = make_case(
        num_tokens, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, has_norm, num_blocks, block_size, seed=0)
    qkv, positions, slots = qkv.cuda(), positions.cuda(), slots.cuda()
    q_weight, k_weight = (w.cuda() if w is not None else None for w in (q_weight, k_weight))
    cos_sin = cos_sin_table(HEAD_DIM, base=1e6).cuda()
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    v_cache = torch.full_like(k_cache, float("nan"))
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()

    q = qk_norm_rope_store(qkv, positions, cos_sin, q_weight, k_weight, EPS, k_cache, v_cache, slots,
                           NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM)

    ref_q = unfused(qkv, positions, cos_sin, q_weight, k_weight, ref_k_cache, ref_v_cache, slots, NUM_Q_HEADS,
                    NUM_KV_HEADS, HEAD_DIM)
    assert_matches_unfused(q, ref_q, has_norm)
    assert_matches_unfused(k_cache, ref_k_cache, has_norm)
    assert torch.equal(v_cache.nan_to_num(7.0), ref_v_cache.nan_to_num(7.0))


def test_qk_norm_rope_store_replayed_from_a_cuda_graph_matches_eager() -> None:
    num_tokens, block_size, num_blocks = 64, 16, 16
    qkv, positions, cos_sin, q_weight, k_weight, slots = (
        t.cuda() for t in make_case(num_tokens, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, True,
                                    num_blocks, block_size, seed=1))
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)

    def step() -> torch.Tensor:
        return qk_norm_rope_store(qkv, positions, cos_sin, q_weight, k_weight, EPS, k_cache, v_cache, slots,
                                  NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out = step()

    for seed in range(3):
        new = make_case(num_tokens, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, True, num_blocks,
                        block_size, seed=10 + seed)
        for static, fresh in zip((qkv, positions, cos_sin, q_weight, k_weight, slots), new):
            static.copy_(fresh)
        k_cache.zero_()
        v_cache.zero_()
        graph.replay()
        replayed = (q_out.clone(), k_cache.clone(), v_cache.clone())
        k_cache.zero_()
        v_cache.zero_()
        eager = (step(), k_cache, v_cache)
        for a, b in zip(replayed, eager):
            assert torch.equal(a, b)
