"""The fp8 KV cache on a real GPU: the kernels compiled for it at Qwen3-0.6B attention shapes (16 query
heads, 8 KV heads, head_dim 128), bf16 queries, CUDA graphs, and the engine end to end.

The CPU tests (test_fp8_kv_cache.py, tests/test_kv_cache_fp8.py) check the same things under the
Triton interpreter; here the compiled code must agree with them: the store kernels write the bytes of
torch's CUDA cast and of the hardware's own `cvt.rn.satfinite` conversion, attention equals float64
over the dequantized cache. Run with `pytest -m gpu` (scripts/gpu_tests.sh).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.gpu_correctness import check_logprobs_close, runner_greedy  # noqa: E402
from deltaserve import SamplingParams  # noqa: E402
from gpu_kernels import paged_attention_decode, paged_attention_prefill, qk_norm_rope_store, store_kvcache  # noqa: E402
from gpu_kernels.fp8 import e4m3_codes  # noqa: E402
from tests.conftest import synthetic_prompt  # noqa: E402
from tests.test_engine_vs_hf import ID_PROMPTS, TEXT_PROMPTS, prompt_ids  # noqa: E402
from tests.test_kv_cache_fp8 import engine_scales, hf_greedy_with_e4m3_kv  # noqa: E402
from workers.kv_cache import FP8_KV_DTYPE, quantize_fp8  # noqa: E402

from .test_fp8_kv_cache import all_e4m3_values  # noqa: E402
from .test_paged_attention import reference_attention, relative_error  # noqa: E402
from .test_rope_kv_store import EPS, make_case, unfused  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
SCALE = HEAD_DIM**-0.5
BF16_RTOL = 1e-2


@triton.jit
def _native_e4m3_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, x.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=mask)


def test_e4m3_rounding_on_the_gpu_equals_torch_and_the_hardware_conversion() -> None:
    values = all_e4m3_values()
    midpoints = (values[1:] + values[:-1]) / 2
    inf = torch.tensor(float("inf"))
    torch.manual_seed(0)
    x = torch.cat([torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float(), midpoints,
                   torch.nextafter(midpoints, inf), torch.nextafter(midpoints, -inf), -midpoints,
                   torch.randn(1 << 20) * torch.exp2(torch.randint(-30, 20, (1 << 20,)).float())]).cuda()
    x = x[~x.isnan()]
    ours = e4m3_codes(x)
    assert torch.equal(ours, quantize_fp8(x, 1.0).view(torch.uint8))
    clamped = x.clamp(-448, 448)  # the native cast need not saturate; ours must equal it inside the range
    native = torch.empty_like(ours)
    _native_e4m3_kernel[(triton.cdiv(x.numel(), 1024),)](clamped, native, x.numel(), BLOCK=1024)
    assert torch.equal(ours, native)


def fp8_paged_kv(seq_lens: list[int], block_size: int, k_scale: float, v_scale: float):
    """Random bf16 keys (order 1) and values (order 0.01) of each sequence, stored by `store_kvcache` into
    an fp8 cache over shuffled blocks; returns the caches, block tables and the dequantized keys and values."""
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 1
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.empty(shape, dtype=FP8_KV_DTYPE, device="cuda")
    k_cache.view(torch.uint8).fill_(0x7E)  # 448: would dominate any softmax it leaked into
    v_cache = k_cache.clone()
    free = torch.randperm(num_blocks).tolist()
    spare = free.pop()
    tables = torch.full((len(seq_lens), max(blocks_needed, default=0) + 1), spare, dtype=torch.int32)
    keys, values = [], []
    for b, (n, count) in enumerate(zip(seq_lens, blocks_needed)):
        owned = [free.pop() for _ in range(count)]
        tables[b, :count] = torch.tensor(owned, dtype=torch.int32)
        positions = torch.arange(n)
        slots = (torch.tensor(owned, dtype=torch.long)[positions // block_size] * block_size
                 + positions % block_size).cuda()
        key = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        value = (0.01 * torch.randn(n, NUM_KV_HEADS, HEAD_DIM, device="cuda")).bfloat16()
        store_kvcache(key, value, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
        for cache, x, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
            stored = cache.view(torch.uint8).view(-1, NUM_KV_HEADS, HEAD_DIM)[slots]
            assert torch.equal(stored, quantize_fp8(x, scale).view(torch.uint8))
        keys.append(quantize_fp8(key, k_scale).double() * k_scale)
        values.append(quantize_fp8(value, v_scale).double() * v_scale)
    return k_cache, v_cache, tables.cuda(), keys, values


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize(("batch", "max_context"), [(1, 4096), (8, 4096), (256, 2048)])
def test_decode_and_prefill_over_an_fp8_cache_match_the_dequantized_reference(block_size: int, batch: int,
                                                                              max_context: int) -> None:
    rng = random.Random(batch * block_size)
    torch.manual_seed(batch * block_size)
    seq_lens = [rng.randint(1, max_context) for _ in range(batch)]
    k_scale, v_scale = 2.0**-5, 2.0**-12
    k_cache, v_cache, tables, keys, values = fp8_paged_kv(seq_lens, block_size, k_scale, v_scale)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = paged_attention_decode(q, k_cache, v_cache, tables, lens, SCALE, k_scale=k_scale, v_scale=v_scale)
    assert relative_error(out, reference_attention(q, keys, values, [1] * batch, SCALE)) < BF16_RTOL
    # Prefill the last min(len, 300) positions of every sequence (chunks after a cached context).
    q_lens = [min(n, 300) for n in seq_lens]
    q = torch.randn(sum(q_lens), NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    out = paged_attention_prefill(q, k_cache, v_cache, tables, starts, lens, max(q_lens), SCALE, k_scale=k_scale,
                                  v_scale=v_scale)
    assert relative_error(out, reference_attention(q, keys, values, q_lens, SCALE)) < BF16_RTOL


def test_decode_over_an_fp8_cache_replays_from_a_cuda_graph() -> None:
    torch.manual_seed(1)
    seq_lens = [700, 1, 0, 2000]
    k_cache, v_cache, tables, _, _ = fp8_paged_kv([700, 1, 1, 2000], 16, 0.25, 2.0**-10)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(4, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    eager = paged_attention_decode(q, k_cache, v_cache, tables, lens, SCALE, k_scale=0.25, v_scale=2.0**-10)
    out = torch.zeros_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_decode(q, k_cache, v_cache, tables, lens, SCALE, out=out, k_scale=0.25, v_scale=2.0**-10)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # a padding row


def test_fused_norm_rope_store_into_fp8_writes_the_codes_of_the_unfused_layers() -> None:
    num_blocks, block_size = 64, 16
    qkv, positions, cos_sin, q_weight, k_weight, slots = make_case(
        300, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, True, num_blocks, block_size, seed=2)
    qkv, positions, cos_sin, slots = qkv.cuda(), positions.cuda(), cos_sin.cuda(), slots.cuda()
    q_weight, k_weight = q_weight.cuda(), k_weight.cuda()
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    caches = [torch.zeros(shape, dtype=FP8_KV_DTYPE, device="cuda") for _ in range(4)]
    qk_norm_rope_store(qkv, positions, cos_sin, q_weight, k_weight, EPS, caches[0], caches[1], slots, NUM_Q_HEADS,
                       NUM_KV_HEADS, HEAD_DIM, k_scale=0.125, v_scale=0.5)
    ref_k = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    ref_v = ref_k.clone()
    unfused(qkv, positions, cos_sin, q_weight, k_weight, ref_k, ref_v, slots, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM)
    flat = slots.clamp_min(0)
    store_kvcache(ref_k.view(-1, NUM_KV_HEADS, HEAD_DIM)[flat], ref_v.view(-1, NUM_KV_HEADS, HEAD_DIM)[flat],
                  caches[2], caches[3], slots, k_scale=0.125, v_scale=0.5)
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    got, want = caches[0].view(torch.uint8).int(), caches[2].view(torch.uint8).int()
    assert (got - want).abs().max().item() <= 1
    assert (got == want).float().mean().item() > 0.99


# ------------------------------------------------------------------------------------------ engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SMALL = dict(max_num_seqs=16, cuda_graph_sizes=[1, 2, 4, 8, 16], kv_cache_memory_gb=1.0)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_fp32_engine_with_an_fp8_cache_equals_transformers_with_e4m3_keys_and_values(
        tiny_qwen3_trained_scale: Path, engine_factory, enforce_eager: bool) -> None:
    """The fused QK-norm kernel may put a key one float32 unit from transformers' value and so, rarely, on
    the other side of an e4m3 rounding boundary: a checkpoint of a trained model's scale keeps such a
    one-step change of one element from moving a greedy token (tiny_qwen3's init range 0.5 would not)."""
    model = tiny_qwen3_trained_scale
    scales = engine_scales(model, device="cuda", dtype="float32")
    expected, _ = hf_greedy_with_e4m3_kv(model, prompt_ids(model), scales)
    llm = engine_factory(model, device="cuda", dtype="float32", attention_backend="triton", block_size=16,
                         max_model_len=1024, max_num_batched_tokens=64, enforce_eager=enforce_eager,
                         kv_cache_dtype="fp8", **SMALL)
    outputs = llm.generate(TEXT_PROMPTS + ID_PROMPTS, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == expected


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_bf16_greedy_tokens_with_an_fp8_cache_follow_the_bf16_cache_by_the_top5_rule(
        tiny_qwen3_trained_scale: Path, enforce_eager: bool) -> None:
    prompts = [synthetic_prompt(n, seed=n) for n in (5, 17, 40, 90, 130, 200, 333, 700)]
    runs = [runner_greedy(str(tiny_qwen3_trained_scale), prompts, "triton", enforce_eager, "cuda", "bfloat16", kv, 16)
            for kv in ("auto", "fp8")]
    checks = [check_logprobs_close(*args) for args in zip(runs[0].tokens, runs[0].top, runs[1].tokens, runs[1].top)]
    assert all(c["ok"] for c in checks), checks
