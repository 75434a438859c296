"""qk_norm_rope_store gives the numbers of the unfused layers (QK-norm, RoPE, KV store), and a model
run with it gives the tokens of the unfused model.

The reference is the production unfused path: `rms_norm`, `apply_rotary` and `store_kv_torch`.
Without QK-norm the kernel must agree bit for bit. With it, the mean-square sum runs in another
order than torch's, so an element may be a few units in the last place off; in 16-bit dtypes
that rounding hides almost always, so nearly every element must still be bit-equal. Runs under
the Triton interpreter on CPU when there is no GPU (see conftest.py).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import gpu_kernels  # noqa: E402
from gpu_kernels import qk_norm_rope_store  # noqa: E402
from workers.attention.torch_backend import store_kv_torch  # noqa: E402
from workers.layers.norm import rms_norm  # noqa: E402
from workers.layers.rotary import apply_rotary  # noqa: E402

EPS = 1e-6
MAX_POSITION = 512


def cos_sin_table(head_dim: int, max_position: int = MAX_POSITION, base: float = 10000.0) -> torch.Tensor:
    """`[max_position, head_dim]` float32, the layout of `RotaryEmbedding.cos_sin_cache`."""
    inv_freq = (1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)).float()
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def poisoned_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> torch.Tensor:
    return torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)


def unfused(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, q_weight: torch.Tensor | None,
            k_weight: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
            num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """What LlamaAttention does without the fused kernel, op by op (never the torch.compile'd
    versions, which a GPU session may have switched on): returns q, stores k and v."""
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(-1, num_heads, head_dim)
    k = k.reshape(-1, num_kv_heads, head_dim)
    v = v.reshape(-1, num_kv_heads, head_dim)
    if q_weight is not None:
        q, k = rms_norm.__wrapped__(q, q_weight, EPS), rms_norm.__wrapped__(k, k_weight, EPS)
    q, k = apply_rotary.__wrapped__(positions, q, k, cos_sin)
    store_kv_torch(k, v, k_cache, v_cache, slots)
    return q


def assert_matches_unfused(out: torch.Tensor, ref: torch.Tensor, has_norm: bool) -> None:
    """Bit for bit without QK-norm; with it, within a few units in the last place (NaN = NaN)."""
    out, ref = out.nan_to_num(7.0), ref.nan_to_num(7.0)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if not has_norm:
        assert torch.equal(out, ref)
        return
    atol = 4 * torch.finfo(ref.dtype).eps * ref.abs().max().item()
    torch.testing.assert_close(out, ref, rtol=0.0, atol=atol)
    if ref.dtype != torch.float32:
        assert (out == ref).float().mean().item() > 0.99


def make_case(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              has_norm: bool, num_blocks: int, block_size: int, seed: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                         torch.Tensor]:
    """(qkv, positions, cos_sin, q_weight, k_weight, slots); every third slot is padding (-1)."""
    torch.manual_seed(seed)
    qkv = (3 * torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)).to(dtype)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,))
    q_weight = (1 + torch.randn(head_dim)).to(dtype) if has_norm else None
    k_weight = (1 + torch.randn(head_dim)).to(dtype) if has_norm else None
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::3] = -1
    return qkv, positions, cos_sin_table(head_dim), q_weight, k_weight, slots


def compare_with_unfused(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                         has_norm: bool, num_blocks: int, block_size: int, seed: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the fused kernel and the unfused layers on one random case (NaN-poisoned caches); assert they
    agree; return the fused run's (k_cache, v_cache, slot_mapping)."""
    qkv, positions, cos_sin, q_weight, k_weight, slots = make_case(
        num_tokens, num_heads, num_kv_heads, head_dim, dtype, has_norm, num_blocks, block_size, seed=seed)
    k_cache = poisoned_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    v_cache = poisoned_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    q = qk_norm_rope_store(qkv, positions, cos_sin, q_weight, k_weight, EPS, k_cache, v_cache, slots,
                           num_heads, num_kv_heads, head_dim)
    ref_q = unfused(qkv, positions, cos_sin, q_weight, k_weight, ref_k_cache, ref_v_cache, slots,
                    num_heads, num_kv_heads, head_dim)
    assert_matches_unfused(q, ref_q, has_norm)
    assert_matches_unfused(k_cache, ref_k_cache, has_norm)
    assert torch.equal(v_cache.nan_to_num(7.0), ref_v_cache.nan_to_num(7.0))
    return k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("has_norm", [True, False], ids=["qk-norm", "rope-only"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (2, 2)], ids=["gqa", "mha"])
@pytest.mark.parametrize("block_size", [16, 4])
def test_fused_equals_unfused_norm_rope_and_store(dtype: torch.dtype, has_norm: bool, num_heads: int,
                                                  num_kv_heads: int, block_size: int) -> None:
    head_dim, num_blocks = 64, 6
    k_cache, v_cache, slots = compare_with_unfused(13, num_heads, num_kv_heads, head_dim, dtype, has_norm,
                                                   num_blocks, block_size, seed=block_size)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    for cache in (k_cache, v_cache):
        flat = cache.view(-1, num_kv_heads, head_dim)
        assert flat[~written].isnan().all(), "a padding token or an unused slot was written"
        assert not flat[written].isnan().any()


@pytest.mark.parametrize("heads_per_program", [1, 2])
def test_each_head_tiling_gives_the_same_result(heads_per_program: int) -> None:
    """The GPU runs one head per program; the interpreter default takes all heads in one program."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 16
    qkv, positions, cos_sin, q_weight, k_weight, slots = make_case(
        7, num_heads, num_kv_heads, head_dim, torch.bfloat16, True, 2, block_size, seed=3)
    results = []
    for tiling in (None, heads_per_program):
        k_cache = poisoned_cache(2, block_size, num_kv_heads, head_dim, torch.bfloat16)
        v_cache = k_cache.clone()
        q = qk_norm_rope_store(qkv, positions, cos_sin, q_weight, k_weight, EPS, k_cache, v_cache, slots,
                               num_heads, num_kv_heads, head_dim, heads_per_program=tiling)
        results.append([t.nan_to_num(7.0) for t in (q, k_cache, v_cache)])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_head_dim_that_is_not_a_power_of_two_is_masked() -> None:
    compare_with_unfused(5, 3, 1, 48, torch.bfloat16, True, 3, 4, seed=4)


def test_reads_rows_of_a_wider_buffer() -> None:
    """qkv may be a row-strided view (stride 1 within a row)."""
    num_heads, num_kv_heads, head_dim = 2, 1, 32
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv, positions, cos_sin, _, _, slots = make_case(5, num_heads, num_kv_heads, head_dim, torch.float32, False,
                                                     2, 4, seed=5)
    wide = torch.zeros(5, width + 8)
    wide[:, :width] = qkv
    caches = [poisoned_cache(2, 4, num_kv_heads, head_dim, torch.float32) for _ in range(4)]

    q = qk_norm_rope_store(wide[:, :width], positions, cos_sin, None, None, EPS, caches[0], caches[1], slots,
                           num_heads, num_kv_heads, head_dim)

    ref_q = unfused(qkv, positions, cos_sin, None, None, caches[2], caches[3], slots, num_heads, num_kv_heads,
                    head_dim)
    assert torch.equal(q, ref_q)
    for out, ref in zip(caches[:2], caches[2:]):
        assert torch.equal(out.nan_to_num(7.0), ref.nan_to_num(7.0))


def test_zero_tokens_store_nothing() -> None:
    cache = poisoned_cache(1, 4, 1, 32, torch.float32)
    q = qk_norm_rope_store(torch.empty(0, 4 * 32), torch.empty(0, dtype=torch.int64), cos_sin_table(32), None, None,
                           EPS, cache, cache.clone(), torch.empty(0, dtype=torch.int64), 2, 1, 32)
    assert q.shape == (0, 2, 32) and cache.isnan().all()


def test_inconsistent_arguments_are_refused() -> None:
    num_heads, num_kv_heads, head_dim = 2, 1, 32
    qkv = torch.randn(3, 4 * head_dim)
    positions, slots = torch.arange(3), torch.arange(3)
    cos_sin, weight = cos_sin_table(head_dim), torch.ones(head_dim)
    cache = torch.zeros(2, 4, num_kv_heads, head_dim)

    def call(**changed: object) -> None:
        args = dict(qkv=qkv, positions=positions, cos_sin_cache=cos_sin, q_norm_weight=weight,
                    k_norm_weight=weight, eps=EPS, k_cache=cache, v_cache=cache.clone(), slot_mapping=slots,
                    num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
        qk_norm_rope_store(**{**args, **changed})

    call()  # the unchanged arguments are accepted
    with pytest.raises(ValueError, match="qkv"):
        call(qkv=qkv[:, :-head_dim])
    with pytest.raises(ValueError, match="qkv dtype"):
        call(qkv=qkv.double())
    with pytest.raises(ValueError, match="stride 1"):
        call(qkv=torch.randn(4 * head_dim, 3).t())
    with pytest.raises(ValueError, match="even"):
        call(head_dim=33, qkv=torch.randn(3, 4 * 33))
    with pytest.raises(ValueError, match="positions"):
        call(positions=positions[:2])
    with pytest.raises(ValueError, match="slot_mapping"):
        call(slot_mapping=slots.float())
    with pytest.raises(ValueError, match="cos_sin_cache"):
        call(cos_sin_cache=cos_sin.bfloat16())
    with pytest.raises(ValueError, match="both"):
        call(k_norm_weight=None)
    with pytest.raises(ValueError, match="q_norm_weight"):
        call(q_norm_weight=weight.bfloat16())
    with pytest.raises(ValueError, match="k_cache"):
        call(k_cache=torch.zeros(2, 4, 2, head_dim))
    with pytest.raises(ValueError, match="v_cache dtype"):
        call(v_cache=cache.bfloat16())
    with pytest.raises(ValueError, match="contiguous"):
        call(k_cache=cache.transpose(0, 1))


# ---------------------------------------------------------------------------------------- whole model


def run_model(model: Path, dtype: str, fused: bool, attention_backend: str = "torch", kv_cache_dtype: str = "auto"
              ) -> tuple[list[list[int]], list[torch.Tensor], torch.Tensor, int]:
    """Prefill three prompts, then decode them for 6 steps through a CPU ModelRunner.

    Returns (tokens per step, logits per step, the KV cache, calls of the fused kernel).
    """
    from common.config import EngineConfig
    from common.protocol import NewRequest, StepPlan, i32
    from tests.conftest import synthetic_prompt
    from workers.layers.fused import force_fused_kernels
    from workers.model_runner import ModelRunner

    cfg = EngineConfig(model=str(model), device="cpu", dtype=dtype, block_size=16, max_model_len=128,
                       max_num_seqs=4, attention_backend=attention_backend, kv_cache_dtype=kv_cache_dtype).resolve()
    with pytest.MonkeyPatch.context() as env:
        # The matmuls stay F.linear's: this compares the rope kernel alone (tests/kernels/test_gemv.py runs
        # a model through the GEMV kernel), and the interpreter would spend seconds on each LM head.
        env.setenv("DELTASERVE_GEMV_MAX_BATCH", "0")
        runner = ModelRunner(cfg, 0, "tcp://127.0.0.1:0")
    runner.allocate_kv_cache(12)
    prompts = [synthetic_prompt(n, seed=n) for n in (20, 33, 7)]
    blocks = [[0, 1, 2], [4, 5, 6], [8, 9]]
    plans = [StepPlan(0, new_requests=[NewRequest(i, i32(p), 0.0, None, i32(b), 0, len(p))
                                       for i, (p, b) in enumerate(zip(prompts, blocks))])]
    plans += [StepPlan(s, decode_seq_ids=i32([0, 1, 2])) for s in range(1, 7)]
    logits: list[torch.Tensor] = []
    compute_logits, kernel = runner.model.compute_logits, gpu_kernels.qk_norm_rope_store
    calls = 0

    def recorded(hidden: torch.Tensor) -> torch.Tensor:
        logits.append(compute_logits(hidden))
        return logits[-1]

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return kernel(*args, **kwargs)

    tokens = []
    with pytest.MonkeyPatch.context() as mp, force_fused_kernels() if fused else contextlib.nullcontext():
        mp.setattr(gpu_kernels, "qk_norm_rope_store", counted)
        mp.setattr(runner.model, "compute_logits", recorded)
        for plan in plans:
            tokens.append(runner.finalize(runner.execute(plan)).tolist())
    return tokens, logits, runner.kv_cache.clone(), calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen3_with_the_fused_kernel_decodes_like_the_unfused_model(tiny_qwen3: Path, dtype: str) -> None:
    tokens, logits, kv_cache, calls = run_model(tiny_qwen3, dtype, fused=True)
    ref_tokens, ref_logits, ref_kv_cache, ref_calls = run_model(tiny_qwen3, dtype, fused=False)

    assert calls == 2 * 7 and ref_calls == 0  # two layers, seven steps
    assert tokens == ref_tokens
    rtol = 1e-4 if dtype == "float32" else 2e-2
    for out, ref in zip(logits, ref_logits):
        torch.testing.assert_close(out, ref, rtol=rtol, atol=rtol * ref.abs().max().item())
    assert_matches_unfused(kv_cache, ref_kv_cache, has_norm=True)


@pytest.mark.parametrize("attention_backend", ["torch", "triton"])
def test_llama_with_the_fused_kernel_equals_the_unfused_model_bit_for_bit(tiny_llama: Path,
                                                                          attention_backend: str) -> None:
    """Without QK-norm nothing is summed, so every logit and cached key is the same float."""
    tokens, logits, kv_cache, calls = run_model(tiny_llama, "float32", fused=True,
                                                attention_backend=attention_backend)
    ref_tokens, ref_logits, ref_kv_cache, _ = run_model(tiny_llama, "float32", fused=False,
                                                        attention_backend=attention_backend)

    assert calls == 2 * 7
    assert tokens == ref_tokens
    for out, ref in zip(logits, ref_logits):
        assert torch.equal(out, ref)
    assert torch.equal(kv_cache, ref_kv_cache)
