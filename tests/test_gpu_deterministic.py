"""Deterministic mode on a GPU (issue 34): bitwise the same tokens and logprobs alone and in batches, in bf16 with
CUDA graphs; run them with scripts/gpu_tests.sh. DELTASERVE_TEST_DEMO_MODEL=DIR adds the trained demo model (a
converted SmolLM2 folder)."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator

import pytest
import torch

from deltaserve import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MAX_TOKENS = 32
_RNG = random.Random(34)
PROMPTS = [[_RNG.randrange(200, 40000) for _ in range(_RNG.randint(4, 120))] for _ in range(64)]


def _bits(out: dict) -> tuple:
    sample = out["outputs"][0]
    assert out["error"] is None, out["error"]
    return (tuple(sample["token_ids"]),
            tuple((e["token_id"], e["logprob"], tuple((t["token_id"], t["logprob"]) for t in e["top"]))
                  for e in sample["logprobs"]))


def _assert_same_bits(got: list[tuple], alone: list[tuple]) -> None:
    """Each request's bits equal its bits alone; the message names, per differing request, the first token and
    the first logprob entry that differ."""
    problems = []
    for i, (g, a) in enumerate(zip(got, alone)):
        if g == a:
            continue
        token = next((j for j, (x, y) in enumerate(zip(g[0], a[0])) if x != y), None)
        entry = next((j for j, (x, y) in enumerate(zip(g[1], a[1])) if x != y), None)
        problems.append(f"request {i} ({'greedy' if i % 2 == 0 else 'seeded'}): first token differing {token}, "
                        f"first logprob entry differing {entry}: {g[1][entry] if entry is not None else ''} "
                        f"vs alone {a[1][entry] if entry is not None else ''}")
    assert not problems, f"{len(problems)} of {len(alone)} requests differ:\n" + "\n".join(problems)


def _params(i: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    return SamplingParams(temperature=1.0, top_p=0.95, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module", params=["tiny_qwen3", "demo"])
def model_dir(request: pytest.FixtureRequest) -> str:
    if request.param == "demo":
        demo = os.environ.get("DELTASERVE_TEST_DEMO_MODEL")
        if not demo:
            pytest.skip("DELTASERVE_TEST_DEMO_MODEL (a converted SmolLM2 folder) is not set")
        return demo
    return str(request.getfixturevalue("tiny_qwen3"))


@pytest.fixture(scope="module")
def deterministic_engine(model_dir: str) -> Iterator:
    """One engine per model for the batch tests (starting one captures CUDA graphs for every bucket), with the 64
    requests' bits computed alone. 8,192 KV blocks hold every batch below at once: the tests' scheduler checks its
    block accounting every step (tests/conftest.py), which at a memory budget's count (a million blocks of the
    tiny model's 4 KiB) took a third of a second a step."""
    from deltaserve import LLM

    t0 = time.perf_counter()
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", deterministic=True, max_model_len=1024,
              max_num_seqs=256, enable_prefix_caching=False, num_kvcache_blocks=8192)
    print(f"\n[{model_dir}] engine up in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        t0 = time.perf_counter()
        alone = [_bits(llm.generate([p], _params(i), use_tqdm=False)[0]) for i, p in enumerate(PROMPTS)]
        print(f"[{model_dir}] {len(PROMPTS)} requests alone in {time.perf_counter() - t0:.1f} s", flush=True)
        yield llm, alone
    finally:
        llm.shutdown()


@pytest.mark.parametrize("neighbours", [7, 64, 192])
def test_requests_get_the_same_bits_alone_and_among_neighbours(deterministic_engine, neighbours: int) -> None:
    llm, alone = deterministic_engine
    rng = random.Random(neighbours)
    others = [[rng.randrange(200, 40000) for _ in range(rng.randint(2, 300))] for _ in range(neighbours)]
    order = list(range(len(PROMPTS) + neighbours))
    rng.shuffle(order)
    batch = PROMPTS + others
    params = [_params(i) for i in range(len(PROMPTS))] + [
        SamplingParams(temperature=0.7, max_tokens=rng.randint(1, 60), ignore_eos=True) for _ in range(neighbours)]
    t0 = time.perf_counter()
    outs = llm.generate([batch[j] for j in order], [params[j] for j in order], use_tqdm=False)
    print(f"\n{neighbours} neighbours in {time.perf_counter() - t0:.1f} s", flush=True)
    got = {j: o for j, o in zip(order, outs)}
    _assert_same_bits([_bits(got[i]) for i in range(len(PROMPTS))], alone)


def test_chunked_prefill_and_preemption_give_the_same_bits(deterministic_engine, model_dir: str,
                                                           engine_factory) -> None:
    _, alone = deterministic_engine
    t0 = time.perf_counter()
    chunked = engine_factory(model_dir, device="cuda", dtype="bfloat16", deterministic=True, max_model_len=1024,
                             max_num_batched_tokens=37, num_kvcache_blocks=64)
    outs = chunked.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))], use_tqdm=False)
    print(f"\nchunked prefill with preemption in {time.perf_counter() - t0:.1f} s", flush=True)
    _assert_same_bits([_bits(o) for o in outs], alone)
