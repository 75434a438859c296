"""Three steps in flight on a GPU (`max_steps_in_flight=3`): the worker launches step N+2 before step N's result
is sent, keeps a set of host buffers per step in flight and receives tokens in launch order. Run with
scripts/gpu_tests.sh."""

from __future__ import annotations

import random
import re

import pytest
import torch

from deltaserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

_RNG = random.Random(3)
PROMPTS = [[_RNG.randrange(200, 40000) for _ in range(_RNG.randint(4, 60))] for _ in range(24)]


def _params(i: int) -> SamplingParams:
    """Greedy, seeded top-p, and plain rows, every one with the same length (ignore_eos), so both engines run the
    same batches step for step."""
    if i % 3 == 0:
        return SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=3)
    if i % 3 == 1:
        return SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=40, ignore_eos=True, logprobs=3)
    return SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _tokens_and_logprobs(out: dict) -> tuple:
    assert out["error"] is None, out["error"]
    sample = out["outputs"][0]
    return tuple(sample["token_ids"]), tuple(
        (e["token_id"], e["logprob"], tuple(t["token_id"] for t in e["top"])) for e in sample["logprobs"] or [])


def _run(model: str, max_steps_in_flight: int) -> tuple[list[tuple], list[dict]]:
    llm = LLM(model, device="cuda", dtype="bfloat16", max_model_len=256, max_steps_in_flight=max_steps_in_flight,
              kv_cache_memory_gb=1)
    try:
        plain = [_tokens_and_logprobs(o) for o in
                 llm.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))], use_tqdm=False)]
        # Constrained rows among plain ones: their grammars complete, then only end tokens are allowed.
        constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=24,
                                      structured_outputs={"regex": "[a-z]{3,8}"} if i % 2 else None)
                       for i in range(len(PROMPTS))]
        mixed = llm.generate(PROMPTS, constrained, use_tqdm=False)
    finally:
        llm.shutdown()
    return plain, mixed


def test_three_steps_in_flight_give_what_two_give_and_keep_grammars_in_order(tiny_qwen3) -> None:
    two, _ = _run(str(tiny_qwen3), 2)
    three, mixed = _run(str(tiny_qwen3), 3)
    assert [t for t, _ in three] == [t for t, _ in two]  # the same batches, step for step: the same tokens
    for (_, a), (_, b) in zip(three, two):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert x[0] == y[0] and x[2] == y[2] and abs(x[1] - y[1]) < 1e-6
    for i, out in enumerate(mixed):
        assert out["error"] is None, out["error"]
        if i % 2:  # a matcher fed out of order would refuse a token or let the text leave the regex
            assert out["finish_reason"] == "stop" and re.fullmatch("[a-z]{3,8}", out["text"]), out
        else:
            assert len(out["token_ids"]) <= 24
