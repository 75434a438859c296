"""The failure scenarios of scenarios.md, through the whole engine with a real (tiny) model.

Lengths are scaled from the scenarios' block size of 256 to our 16 (a "512-token prompt"
becomes 32 tokens, "max_tokens 1024" becomes 64). The baseline of every output is Hugging Face
greedy decoding on the same weights. Every engine here runs with DELTASERVE_CHECK_INVARIANTS=1
(tests/conftest.py): the scheduler asserts the block-accounting invariants after each step, and
a violation would kill the engine and fail the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from deltaserve import LLM, SamplingParams
from tests.conftest import synthetic_prompt
from tests.test_engine_vs_hf import hf_greedy

B = 16


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def baseline(model: Path, prompt: list[int], n: int) -> list[int]:
    return hf_greedy(str(model), tuple(prompt), n)


@pytest.fixture(scope="module")
def default_engine(tiny_qwen3: Path) -> Iterator[LLM]:
    """One engine (block size B, max_model_len 256, the default cache) for the scenarios that need nothing else: an
    engine start is most of such a test's time on CPU. Their prompts come from seeds of their own, so none of them
    finds another's blocks in the prefix cache."""
    llm = LLM(str(tiny_qwen3), device="cpu", block_size=B, max_model_len=256)
    yield llm
    llm.shutdown()


def test_br01_fully_cached_prompt_of_whole_blocks(tiny_qwen3: Path, engine_factory) -> None:
    llm = engine_factory(tiny_qwen3, block_size=B, max_model_len=512)
    for blocks, cached in ((2, 16), (1, 0), (3, 32)):
        prompt = synthetic_prompt(blocks * B, seed=blocks)
        first, second = (llm.generate([prompt], greedy(16), use_tqdm=False)[0] for _ in range(2))
        assert first["token_ids"] == second["token_ids"] == baseline(tiny_qwen3, prompt, 16)
        assert second["num_cached_tokens"] == cached  # the last block is never reused: one token is computed
    prompt = synthetic_prompt(2 * B, seed=100)
    pair = llm.generate([prompt, prompt], greedy(16), use_tqdm=False)
    third = llm.generate([prompt], greedy(16), use_tqdm=False)[0]
    expected = baseline(tiny_qwen3, prompt, 16)
    assert pair[0]["token_ids"] == pair[1]["token_ids"] == third["token_ids"] == expected
    assert third["num_cached_tokens"] == B


def test_br02_and_br13_tiny_cache(tiny_qwen3: Path, engine_factory) -> None:
    llm = engine_factory(tiny_qwen3, block_size=B, max_model_len=256, num_kvcache_blocks=4)
    # BR-02: A's first block is freed with its hash, then every block is reused by B1..B3.
    a_prompt = synthetic_prompt(B, seed=1) + synthetic_prompt(20, seed=2)
    a = llm.generate([a_prompt], greedy(8), use_tqdm=False)[0]
    others = [synthetic_prompt(19, seed=10 + i) for i in range(3)]
    outs = llm.generate(others, greedy(8), use_tqdm=False)
    for prompt, out in zip(others, outs):
        assert out["token_ids"] == baseline(tiny_qwen3, prompt, 8)
    c = llm.generate([a_prompt], greedy(8), use_tqdm=False)[0]
    assert a["token_ids"] == c["token_ids"] == baseline(tiny_qwen3, a_prompt, 8)
    # BR-13: a prompt needing 6 blocks when the cache has 4 fails fast; the others are unharmed.
    small1, big, small2 = synthetic_prompt(6, 21), synthetic_prompt(94, 22), synthetic_prompt(6, 23)
    outs = llm.generate([small1, big, small2], greedy(8), use_tqdm=False)
    assert outs[1]["finish_reason"] == "error" and "needs 6 KV-cache blocks" in outs[1]["error"]
    assert outs[0]["token_ids"] == baseline(tiny_qwen3, small1, 8)
    assert outs[2]["token_ids"] == baseline(tiny_qwen3, small2, 8)
    alone = llm.generate([big], greedy(8), use_tqdm=False)[0]
    assert alone["finish_reason"] == "error" and "only 4 blocks" in alone["error"]


def test_br04_identical_prompts_in_one_step(tiny_qwen3: Path, default_engine: LLM) -> None:
    llm = default_engine
    prompt = synthetic_prompt(2 * B + 6, seed=4)
    other = synthetic_prompt(19, seed=5)
    outs = llm.generate([prompt, prompt, other], greedy(32), use_tqdm=False)
    expected = baseline(tiny_qwen3, prompt, 32)
    assert outs[0]["token_ids"] == outs[1]["token_ids"] == expected
    assert outs[2]["token_ids"] == baseline(tiny_qwen3, other, 32)
    third = llm.generate([prompt], greedy(32), use_tqdm=False)[0]
    assert third["token_ids"] == expected and third["num_cached_tokens"] == 2 * B


def test_br04_stress_eight_copies_in_a_just_large_enough_cache(tiny_qwen3: Path, engine_factory) -> None:
    prompt = synthetic_prompt(2 * B + 6, seed=4)
    # The shared 2 prompt blocks + 2 own blocks per copy (38 + 19 tokens = 4 blocks each).
    llm = engine_factory(tiny_qwen3, block_size=B, max_model_len=256, num_kvcache_blocks=2 + 8 * 2)
    outs = llm.generate([prompt] * 8, greedy(19), use_tqdm=False)
    expected = baseline(tiny_qwen3, prompt, 19)
    assert all(o["token_ids"] == expected for o in outs)


def test_br06_preempted_requests_readmitted_with_prefix_hits(tiny_qwen3: Path, engine_factory) -> None:
    llm = engine_factory(tiny_qwen3, block_size=B, max_model_len=256, num_kvcache_blocks=24,
                         max_num_batched_tokens=256)
    shared = synthetic_prompt(B, seed=6)
    prompts = [shared + synthetic_prompt(3, seed=60 + i) for i in range(16)]
    outs = llm.generate(prompts, greedy(38), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == baseline(tiny_qwen3, prompt, 38)
    assert sum(o["metrics"]["num_preemptions"] for o in outs) > 0


def test_br08_br14_br16_chunked_prefill(tiny_qwen3: Path, engine_factory) -> None:
    llm = engine_factory(tiny_qwen3, block_size=B, max_model_len=64, max_num_batched_tokens=16)
    # BR-08: a 63-token prompt in 4 chunks, alone and beside another one mid-chunk.
    p1, p2 = synthetic_prompt(62, seed=8), synthetic_prompt(60, seed=9)
    assert llm.generate([p1], greedy(1), use_tqdm=False)[0]["token_ids"] == baseline(tiny_qwen3, p1, 1)
    outs = llm.generate([p1, p2], greedy(2), use_tqdm=False)
    assert outs[0]["token_ids"] == baseline(tiny_qwen3, p1, 2)
    assert outs[1]["token_ids"] == baseline(tiny_qwen3, p2, 2)
    # BR-14: over and at max_model_len are rejected naming both lengths; below it, output stops at the limit.
    over, at = llm.generate([synthetic_prompt(65, 1), synthetic_prompt(64, 2)], greedy(8), use_tqdm=False)
    assert "65 tokens" in over["error"] and "max_model_len is 64" in over["error"]
    assert "64 tokens" in at["error"]
    near = synthetic_prompt(60, seed=3)
    out = llm.generate([near], greedy(100), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 4
    assert out["token_ids"] == baseline(tiny_qwen3, near, 4)
    # BR-16: requests that finish at prefill, with chunking, then a normal one.
    prompts = [synthetic_prompt(6 + (i * 7) % 38, seed=200 + i) for i in range(60)]
    outs = llm.generate(prompts, greedy(1), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == baseline(tiny_qwen3, prompt, 1)
    normal = synthetic_prompt(20, seed=300)
    assert llm.generate([normal], greedy(32), use_tqdm=False)[0]["token_ids"] == baseline(tiny_qwen3, normal, 32)


def test_br16_many_one_token_requests_without_chunking(tiny_qwen3: Path, default_engine: LLM) -> None:
    llm = default_engine
    prompts = [synthetic_prompt(6 + (i * 13) % 38, seed=400 + i) for i in range(200)]
    outs = llm.generate(prompts, greedy(1), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == baseline(tiny_qwen3, prompt, 1) and out["finish_reason"] == "length"


def test_br10_decode_crossing_a_block_boundary(tiny_qwen3: Path, engine_factory) -> None:
    two = engine_factory(tiny_qwen3, block_size=B, max_model_len=256, num_kvcache_blocks=2)
    for n in (15, 16, 17, 31):  # each needs at most 2 blocks with 2 output tokens
        prompt = synthetic_prompt(n, seed=n)
        out = two.generate([prompt], greedy(2), use_tqdm=False)[0]
        assert out["token_ids"] == baseline(tiny_qwen3, prompt, 2)
    full = synthetic_prompt(2 * B, seed=32)
    assert two.generate([full], greedy(1), use_tqdm=False)[0]["token_ids"] == baseline(tiny_qwen3, full, 1)
    out = two.generate([full], greedy(2), use_tqdm=False)[0]  # the 2nd token needs a 3rd block: stop at the 1st
    assert out["finish_reason"] == "length" and out["token_ids"] == baseline(tiny_qwen3, full, 1)
    short = synthetic_prompt(10, seed=10)
    out = two.generate([short], greedy(23), use_tqdm=False)[0]  # final length 33: KV for 32 tokens fits
    assert out["finish_reason"] == "length" and out["token_ids"] == baseline(tiny_qwen3, short, 23)
    out = two.generate([short], greedy(24), use_tqdm=False)[0]  # would need KV for 33 tokens
    assert out["finish_reason"] == "length" and out["token_ids"] == baseline(tiny_qwen3, short, 23)
    one = engine_factory(tiny_qwen3, block_size=B, max_model_len=256, num_kvcache_blocks=1)
    block = synthetic_prompt(B, seed=16)
    assert one.generate([block], greedy(1), use_tqdm=False)[0]["token_ids"] == baseline(tiny_qwen3, block, 1)
    out = one.generate([block], greedy(2), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and out["token_ids"] == baseline(tiny_qwen3, block, 1)


def test_br18_preemption_makes_progress_under_kv_pressure(tiny_qwen3: Path, engine_factory) -> None:
    llm = engine_factory(tiny_qwen3, block_size=B, max_model_len=512, num_kvcache_blocks=8)
    prompts = [synthetic_prompt(B, seed=180 + i) for i in range(4)]
    outs = llm.generate(prompts, greedy(64), use_tqdm=False)  # each needs 5 blocks, together 20
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == baseline(tiny_qwen3, prompt, 64)
    assert sum(o["metrics"]["num_preemptions"] for o in outs) < 20
    lone = synthetic_prompt(B, seed=190)
    out = llm.generate([lone], greedy(156), use_tqdm=False)[0]  # needs 11 blocks > 8: stops when the cache is full
    assert out["finish_reason"] == "length"
    assert len(out["token_ids"]) == 8 * B - B + 1  # KV for 128 tokens, plus the token sampled from the last
    assert out["token_ids"] == baseline(tiny_qwen3, lone, len(out["token_ids"]))


def test_br19_temperature_zero_and_mixed_rows(tiny_qwen3: Path, default_engine: LLM) -> None:
    llm = default_engine
    prompt, other = synthetic_prompt(12, seed=19), synthetic_prompt(9, seed=20)
    runs = [llm.generate([prompt], greedy(32), use_tqdm=False)[0]["token_ids"] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2] == baseline(tiny_qwen3, prompt, 32)
    mixed = llm.generate([prompt, prompt, other], [greedy(32), SamplingParams(temperature=0.8, max_tokens=32,
                                                                             ignore_eos=True), greedy(32)],
                         use_tqdm=False)
    assert mixed[0]["token_ids"] == runs[0]
    assert mixed[2]["token_ids"] == baseline(tiny_qwen3, other, 32)
    assert len(mixed[1]["token_ids"]) == 32 and all(0 <= t < 151669 for t in mixed[1]["token_ids"])
    tiny_t = llm.generate([prompt], SamplingParams(temperature=1e-6, max_tokens=32, ignore_eos=True),
                          use_tqdm=False)[0]
    assert tiny_t["token_ids"] == runs[0]
    hot = llm.generate([prompt], SamplingParams(temperature=2.0, max_tokens=32, ignore_eos=True), use_tqdm=False)[0]
    assert len(hot["token_ids"]) == 32 and all(0 <= t < 151669 for t in hot["token_ids"])
    seeded = [llm.generate([prompt, other], SamplingParams(temperature=1.0, max_tokens=16, seed=7, ignore_eos=True),
                           use_tqdm=False)[0]["token_ids"] for _ in range(2)]
    alone = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=16, seed=7, ignore_eos=True),
                         use_tqdm=False)[0]["token_ids"]
    assert seeded[0] == seeded[1] == alone  # same seed, same tokens, whatever shares the batch
