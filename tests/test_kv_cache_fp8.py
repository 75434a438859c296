"""The fp8 KV cache (`kv_cache_dtype="fp8"`) through the worker and the whole engine on CPU: its scales,
its size, and the tokens it gives.

The reference for what an fp8 cache must compute is transformers itself with every key and value
rounded to e4m3 (with the engine's scales) as they enter its cache: the same model, the same
quantization, an independent implementation of everything else.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.gpu_correctness import check_logprobs_close, greedy_generation_config, runner_greedy, top_ids
from common.config import EngineConfig
from common.protocol import NewRequest, StepPlan, i32
from deltaserve import SamplingParams
from tests.conftest import synthetic_prompt
from tests.test_engine_vs_hf import ID_PROMPTS, TEXT_PROMPTS, prompt_ids
from workers.kv_cache import CALIBRATION_LEN, FP8_KV_DTYPE, kv_cache_torch_dtype, quantize_fp8, scale_for
from workers.model_runner import ModelRunner

NUM_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def runner(model: Path, kv_cache_dtype: str, max_model_len: int = 1024, device: str = "cpu",
           dtype: str = "auto") -> ModelRunner:
    cfg = EngineConfig(model=str(model), device=device, dtype=dtype, max_model_len=max_model_len, max_num_seqs=4,
                       kv_cache_dtype=kv_cache_dtype, enforce_eager=True).resolve()
    return ModelRunner(cfg, 0, "tcp://127.0.0.1:0")


def engine_scales(model: Path, device: str = "cpu", dtype: str = "auto") -> list[tuple[float, float]]:
    """The (k_scale, v_scale) of every layer that a worker of this model calibrates."""
    return [(layer.k_scale, layer.v_scale) for layer in runner(model, "fp8", device=device, dtype=dtype).attn_layers]


def hf_greedy_with_e4m3_kv(model: Path, prompts: list[list[int]], scales: list[tuple[float, float]],
                           num_tokens: int = NUM_TOKENS) -> tuple[list[list[int]], list[list[list[int]]]]:
    """transformers' float32 greedy tokens and top-5 ids per step, every key and value rounded to
    e4m3 (`e4m3(x / scale) * scale`, the engine's per-layer scales) as it enters the cache."""
    import transformers.cache_utils as cache_utils
    from transformers import AutoModelForCausalLM

    def rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
        return (quantize_fp8(x, scale).float() * scale).to(x.dtype)

    update = cache_utils.DynamicCache.update

    def update_rounded(self, key, value, layer_idx, *args, **kwargs):
        k_scale, v_scale = scales[layer_idx]
        return update(self, rounded(key, k_scale), rounded(value, v_scale), layer_idx, *args, **kwargs)

    model_ = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    config = greedy_generation_config(model_, num_tokens)
    tokens, tops = [], []
    with pytest.MonkeyPatch.context() as mp, torch.inference_mode():
        mp.setattr(cache_utils.DynamicCache, "update", update_rounded)
        for ids in prompts:
            x = torch.tensor([ids])
            out = model_.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
            tokens.append(out.sequences[0, len(ids):].tolist())
            tops.append(top_ids(torch.stack([step[0] for step in out.logits])))
    return tokens, tops


# ------------------------------------------------------------------------------------------ units


def test_kv_cache_dtype_names_are_vllms() -> None:
    assert kv_cache_torch_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_cache_torch_dtype("auto", torch.float32) is torch.float32
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) is FP8_KV_DTYPE
    assert kv_cache_torch_dtype("fp8_e4m3", torch.float32) is FP8_KV_DTYPE
    with pytest.raises(ValueError, match="fp8_e5m2"):
        kv_cache_torch_dtype("fp8_e5m2", torch.bfloat16)


@pytest.mark.parametrize("amax", [1e-6, 0.013, 0.5, 1.0, 3.7, 112.0, 448.0, 1e5])
def test_scale_is_the_power_of_two_leaving_four_to_eight_times_headroom(amax: float) -> None:
    scale = scale_for(amax)
    assert math.log2(scale) == round(math.log2(scale))
    assert 4 * amax <= 448 * scale < 8 * amax


@pytest.mark.parametrize("amax", [0.0, float("inf"), float("nan")])
def test_scale_is_one_for_a_layer_that_stored_only_zeros_or_non_finite_values(amax: float) -> None:
    assert scale_for(amax) == 1.0


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_calibrated_scales_hold_every_key_and_value_of_prompts_longer_than_the_calibration(
        arch: str, tiny_qwen3: Path, tiny_llama: Path) -> None:
    model = tiny_qwen3 if arch == "qwen3" else tiny_llama
    scales = engine_scales(model)
    plain = runner(model, "auto")
    lengths = [2 * CALIBRATION_LEN, CALIBRATION_LEN + 37, 40]
    blocks = [-(-n // 16) for n in lengths]
    plain.allocate_kv_cache(sum(blocks))
    starts = np.cumsum([0, *blocks])
    plan = StepPlan(0, new_requests=[NewRequest(i, i32(synthetic_prompt(n, seed=i)), 0.0, None,
                                                i32(range(starts[i], starts[i + 1])), 0, n)
                                     for i, n in enumerate(lengths)])
    plain.finalize(plain.execute(plan))
    amax = plain.kv_cache.abs().amax(dim=(2, 3, 4, 5))  # [keys / values, layers]
    for layer, (k_scale, v_scale) in enumerate(scales):
        # At least twice the largest key and value still fits below e4m3's 448.
        assert 2 * amax[0, layer].item() <= 448 * k_scale
        assert 2 * amax[1, layer].item() <= 448 * v_scale


# ------------------------------------------------------------------------------------------ engine


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_with_an_fp8_cache_equals_transformers_with_keys_and_values_rounded_to_e4m3(
        arch: str, tiny_qwen3: Path, tiny_llama: Path, engine_factory) -> None:
    model = tiny_qwen3 if arch == "qwen3" else tiny_llama
    expected, _ = hf_greedy_with_e4m3_kv(model, prompt_ids(model), engine_scales(model))
    llm = engine_factory(model, block_size=16, max_model_len=1024, kv_cache_dtype="fp8")
    outputs = llm.generate(TEXT_PROMPTS + ID_PROMPTS, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == expected


def test_fp8_cache_holds_four_times_the_tokens_of_a_float32_cache(tiny_qwen3: Path, engine_factory) -> None:
    infos = {}
    for kv in ("auto", "fp8"):
        llm = engine_factory(tiny_qwen3, max_model_len=512, kv_cache_memory_gb=2**-7, kv_cache_dtype=kv)
        infos[kv] = llm.info
        llm.shutdown()
    layers, kv_heads, head_dim, block_size = 2, 2, 16, 16
    assert infos["fp8"]["kv_bytes_per_block"] == 2 * layers * kv_heads * head_dim * block_size * 1
    assert infos["auto"]["kv_bytes_per_block"] == 4 * infos["fp8"]["kv_bytes_per_block"]
    assert infos["fp8"]["num_kv_blocks"] == 4 * infos["auto"]["num_kv_blocks"] == 2**30 // 2**7 // 2048


def test_greedy_tokens_with_an_fp8_cache_follow_the_float32_cache_by_the_top5_rule(
        tiny_qwen3_trained_scale: Path, engine_factory) -> None:
    """vLLM's rule (benchmarks/gpu_correctness.py): where the two runs first differ, each token is among
    the other run's 5 most likely; the top-5 come from the worker's own logits, along the engine's path."""
    model = tiny_qwen3_trained_scale
    prompts = [synthetic_prompt(n, seed=n) for n in (5, 17, 40, 90, 130, 200)]
    plain, fp8 = (runner_greedy(str(model), prompts, "torch", True, "cpu", "float32", kv, NUM_TOKENS)
                  for kv in ("auto", "fp8"))
    # The worker's step code gives these tokens in the engine too (with the float32 cache, test_engine_vs_hf.py
    # compares the engine with transformers itself).
    llm = engine_factory(model, block_size=16, max_model_len=1024, kv_cache_dtype="fp8")
    assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == fp8.tokens
    checks = [check_logprobs_close(*args) for args in zip(plain.tokens, plain.top, fp8.tokens, fp8.top)]
    assert all(c["ok"] for c in checks), checks
    assert sum(c["identical"] for c in checks) >= len(prompts) // 2, checks


def test_tp2_ranks_quantize_with_the_scales_of_tp1(tiny_llama: Path, tmp_path: Path, engine_factory, capfd) -> None:
    """Each rank holds one of the two KV heads, here 16 times apart in size; the ranks take the largest
    calibration values over both, so both use the scales a single device uses, and give its tokens."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "llama-uneven-heads"
    shutil.copytree(tiny_llama, model)
    weights = load_file(model / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensor[16:] *= 16  # KV head 1 (head_dim 16)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})

    def logged_scales(tp: int) -> tuple[list[list[int]], dict[str, str]]:
        llm = engine_factory(model, block_size=16, max_model_len=1024, kv_cache_dtype="fp8", tensor_parallel_size=tp,
                             log_level="INFO")
        tokens = [o["token_ids"] for o in llm.generate(TEXT_PROMPTS + ID_PROMPTS, GREEDY, use_tqdm=False)]
        llm.shutdown()
        found = re.findall(r"rank (\d) fp8 KV cache: \(k_scale, v_scale\) per layer (.*)", capfd.readouterr().err)
        return tokens, dict(found)

    tokens1, scales1 = logged_scales(1)
    tokens2, scales2 = logged_scales(2)
    assert set(scales2) == {"0", "1"}
    assert scales2["0"] == scales2["1"] == scales1["0"]
    assert tokens2 == tokens1
