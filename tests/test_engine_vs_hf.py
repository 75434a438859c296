"""Greedy tokens through the whole multi-process engine equal Hugging Face `generate` on the same weights."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch

from deltaserve import SamplingParams
from tests.conftest import synthetic_prompt

NUM_TOKENS = 32
TEXT_PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "大型语言模型是一种人工智能模型。",
    "def add(a, b):\n    return a + b\n",
]
# Prompts of different lengths: texts, plus synthetic ids with a shared 40-token prefix.
SHARED = synthetic_prompt(40, seed=7)
ID_PROMPTS = [synthetic_prompt(3, 1), SHARED + synthetic_prompt(17, 2), SHARED + synthetic_prompt(90, 3),
              synthetic_prompt(150, 4)]


@cache
def hf_greedy(model_dir: str, prompt: tuple[int, ...], num_tokens: int = NUM_TOKENS) -> list[int]:
    """`num_tokens` greedy tokens from transformers' `generate` (EOS ignored), float32."""
    model = _hf_model(model_dir)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                             min_new_tokens=num_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@cache
def _hf_model(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def prompt_ids(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(p)["input_ids"] for p in TEXT_PROMPTS] + ID_PROMPTS


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_tokens_match_transformers(arch: str, tiny_qwen3: Path, tiny_llama: Path, engine_factory) -> None:
    model = tiny_qwen3 if arch == "qwen3" else tiny_llama
    llm = engine_factory(model, block_size=16, max_model_len=1024)
    outputs = llm.generate(TEXT_PROMPTS + ID_PROMPTS, GREEDY, use_tqdm=False)
    for ids, out in zip(prompt_ids(model), outputs):
        assert out["token_ids"] == hf_greedy(str(model), tuple(ids))
        assert out["finish_reason"] == "length"
        assert out["num_prompt_tokens"] == len(ids)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_tokens_match_under_chunking_preemption_and_prefix_hits(
        arch: str, tiny_qwen3: Path, tiny_llama: Path, engine_factory) -> None:
    """A 32-token step budget chunks every long prompt; 40 blocks of 8 tokens cannot hold all 8
    requests at once, so some are preempted and recomputed; the second pass hits the prefix cache."""
    model = tiny_qwen3 if arch == "qwen3" else tiny_llama
    llm = engine_factory(model, block_size=8, max_model_len=1024, max_num_batched_tokens=32, num_kvcache_blocks=40)
    prompts = TEXT_PROMPTS + ID_PROMPTS
    expected = [hf_greedy(str(model), tuple(ids)) for ids in prompt_ids(model)]
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    for out_a, out_b, ref in zip(first, second, expected):
        assert out_a["token_ids"] == ref
        assert out_b["token_ids"] == ref
    assert sum(o["metrics"]["num_preemptions"] for o in first) > 0, "the small cache should force preemption"
    assert sum(o["num_cached_tokens"] for o in second) > 0, "the second pass should hit the prefix cache"


def test_triton_backend_matches_transformers_under_the_interpreter(tiny_qwen3: Path, engine_factory,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU worker's Triton kernels, run on CPU by the Triton interpreter, through the whole engine
    with chunked prefill (prefill kernel over cached context) and decode steps (split-KV kernel)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    llm = engine_factory(tiny_qwen3, attention_backend="triton", block_size=16, max_model_len=1024,
                         max_num_batched_tokens=64)
    prompts = [TEXT_PROMPTS[1], ID_PROMPTS[1], ID_PROMPTS[2]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(prompt_ids(tiny_qwen3)[1:2] + ID_PROMPTS[1:3], outputs):
        assert out["token_ids"] == hf_greedy(str(tiny_qwen3), tuple(ids))[:16]


def test_mistral_checkpoint_without_a_sliding_window_runs_as_llama(tmp_path: Path, qwen3_tokenizer_dir: Path,
                                                                     engine_factory) -> None:
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    torch.manual_seed(5)
    cfg = MistralConfig(vocab_size=151669, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                        sliding_window=None, initializer_range=0.5)
    MistralForCausalLM(cfg).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(qwen3_tokenizer_dir).save_pretrained(tmp_path)
    llm = engine_factory(tmp_path, block_size=16, max_model_len=512)
    outputs = llm.generate(ID_PROMPTS, GREEDY, use_tqdm=False)
    for ids, out in zip(ID_PROMPTS, outputs):
        assert out["token_ids"] == hf_greedy(str(tmp_path), tuple(ids))
