"""Deterministic mode on a GPU (issue 34): bitwise the same tokens and logprobs alone and in batches, in bf16 with
CUDA graphs. The mode's GPU path is gated (DELTASERVE_DETERMINISTIC_GPU=1) until these pass; run them with
scripts/gpu_tests.sh. DELTASERVE_TEST_DEMO_MODEL=DIR adds the trained demo model (a converted SmolLM2 folder)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from deltaserve import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MAX_TOKENS = 32


def _bits(out: dict) -> tuple:
    sample = out["outputs"][0]
    assert out["error"] is None, out["error"]
    return (tuple(sample["token_ids"]),
            tuple((e["token_id"], e["logprob"], tuple((t["token_id"], t["logprob"]) for t in e["top"]))
                  for e in sample["logprobs"]))


def _params(i: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    return SamplingParams(temperature=1.0, top_p=0.95, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def _models(tiny_qwen3) -> list[str]:
    demo = os.environ.get("DELTASERVE_TEST_DEMO_MODEL")
    return [str(tiny_qwen3)] + ([demo] if demo else [])


def test_requests_get_the_same_bits_alone_and_in_batches_on_the_gpu(tiny_qwen3, engine_factory,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTASERVE_DETERMINISTIC_GPU", "1")
    rng = random.Random(34)
    prompts = [[rng.randrange(200, 40000) for _ in range(rng.randint(4, 120))] for _ in range(16)]
    for model in _models(tiny_qwen3):
        llm = engine_factory(model, device="cuda", dtype="bfloat16", deterministic=True, max_model_len=1024,
                             max_num_seqs=256, enable_prefix_caching=False)
        alone = [_bits(llm.generate([p], _params(i), use_tqdm=False)[0]) for i, p in enumerate(prompts)]
        for neighbours in (7, 64, 240):
            others = [[rng.randrange(200, 40000) for _ in range(rng.randint(2, 300))] for _ in range(neighbours)]
            order = list(range(len(prompts) + neighbours))
            rng.shuffle(order)
            batch = prompts + others
            params = [_params(i) for i in range(len(prompts))] + [
                SamplingParams(temperature=0.7, max_tokens=rng.randint(1, 60), ignore_eos=True)] * neighbours
            outs = llm.generate([batch[j] for j in order], [params[j] for j in order], use_tqdm=False)
            got = {j: o for j, o in zip(order, outs)}
            assert [_bits(got[i]) for i in range(len(prompts))] == alone, f"{model}: {neighbours} neighbours"
        chunked = engine_factory(model, device="cuda", dtype="bfloat16", deterministic=True, max_model_len=1024,
                                 max_num_batched_tokens=37, num_kvcache_blocks=64)
        outs = chunked.generate(prompts, [_params(i) for i in range(len(prompts))], use_tqdm=False)
        assert [_bits(o) for o in outs] == alone, f"{model}: chunked prefill, preemption, prefix cache"
