"""Tensor parallelism on CPU: two worker processes joined by torch.distributed over gloo, the same
code that runs over NCCL on GPUs. TP=2 gives the tokens of TP=1 and transformers; what happens when a rank
dies or stops is in tests/test_tensor_parallel_failures.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve import LLM, SamplingParams
from tests.conftest import make_tiny_checkpoint
from tests.test_engine_vs_hf import ID_PROMPTS, TEXT_PROMPTS, hf_greedy, prompt_ids
from workers.process import cores_given

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def tp1_and_tp2(tiny_qwen3: Path) -> Iterator[tuple[LLM, LLM]]:
    """Engines of TP=1 and TP=2 on the tiny Qwen3 with the same engine seed (11), shared by this module's
    sampling tests. Each test sends both the same calls in the same order, so their histories (prefix cache,
    and the engine seed's generator of per-row seeds, advanced once per sampled step) stay equal."""
    engines = [LLM(str(tiny_qwen3), device="cpu", block_size=16, max_model_len=512, tensor_parallel_size=tp, seed=11)
               for tp in (1, 2)]
    yield engines[0], engines[1]
    for llm in engines:
        llm.shutdown()


def generate_at_tp1_and_tp2(engines: tuple[LLM, LLM], prompts: list, params: list) -> list[list[dict]]:
    """`LLM.generate(prompts, params)` on the engine of TP=1, then on that of TP=2."""
    return [llm.generate(prompts, params, use_tqdm=False) for llm in engines]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tp2_greedy_tokens_equal_transformers(arch: str, tiny_qwen3: Path, tiny_llama: Path, engine_factory) -> None:
    """With a cache small enough to preempt, and a second pass that hits the prefix cache. TP=1 with this cache
    against transformers: tests/test_engine_vs_hf.py (chunking, preemption and prefix hits)."""
    model = tiny_qwen3 if arch == "qwen3" else tiny_llama
    prompts = TEXT_PROMPTS + ID_PROMPTS
    expected = [hf_greedy(str(model), tuple(ids)) for ids in prompt_ids(model)]
    tp2 = engine_factory(model, block_size=8, max_model_len=1024, num_kvcache_blocks=40, tensor_parallel_size=2)
    two = tp2.generate(prompts, GREEDY, use_tqdm=False)
    again = tp2.generate(prompts, GREEDY, use_tqdm=False)
    for b, c, ref in zip(two, again, expected):
        assert b["token_ids"] == c["token_ids"] == ref
    assert sum(o["metrics"]["num_preemptions"] for o in two) > 0
    assert sum(o["num_cached_tokens"] for o in again) > 0


def test_one_kv_head_for_two_ranks_and_row_parallel_biases_give_transformers_tokens(
        tmp_path: Path, qwen3_tokenizer_dir: Path, engine_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """One checkpoint for two TP=2 paths (an engine start each would be most of the time): fewer KV heads than ranks
    (each rank keeps a replica of the one head), and biases on o_proj and down_proj, which leave their sums to the
    next norm and so must count once (rank 0). Also: each CPU worker takes its share of the cores."""
    model = make_tiny_checkpoint("llama", tmp_path / "mqa-bias", qwen3_tokenizer_dir, num_key_value_heads=1,
                                 attention_bias=True, mlp_bias=True)
    weights = load_file(model / "model.safetensors")
    biases = [name for name in weights if name.endswith("bias")]
    assert any("o_proj" in n for n in biases) and any("down_proj" in n for n in biases)
    g = torch.Generator().manual_seed(5)
    for name in biases:  # transformers starts biases at zero
        weights[name] = torch.randn(weights[name].shape, generator=g)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # tests/conftest.py sets it for every other engine
    llm = engine_factory(model, block_size=16, max_model_len=512, tensor_parallel_size=2)
    share = max(1, cores_given() // 2)  # each CPU worker took its share of the cores (tests/test_torch_threads.py)
    assert [llm.engine.process_info[f"worker-tp{r}"]["torch_threads"] for r in (0, 1)] == [share, share]
    outs = llm.generate(TEXT_PROMPTS, GREEDY, use_tqdm=False)
    for ids, out in zip(prompt_ids(model), outs):
        assert out["token_ids"] == hf_greedy(str(model), tuple(ids))


def test_tp2_samples_the_same_tokens_as_tp1(tp1_and_tp2: tuple[LLM, LLM]) -> None:
    """Each rank samples its vocabulary slice with noise keyed by the global token id, so random
    sampling at TP=2 draws exactly what TP=1 draws: with a per-request seed, and for requests
    without one from the engine's seed."""
    seeded = [SamplingParams(temperature=t, seed=s, max_tokens=24, ignore_eos=True)
              for t, s in [(0.7, 1), (1.0, 2), (1.5, 3), (0.3, 4)]]
    unseeded = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)] * 4
    prompts = TEXT_PROMPTS[:4] + [TEXT_PROMPTS[0]] * 4  # the same prompt: different outputs are sampling
    one, two = generate_at_tp1_and_tp2(tp1_and_tp2, prompts, seeded + unseeded)
    assert [o["token_ids"] for o in one] == [o["token_ids"] for o in two]
    assert len({tuple(o["token_ids"]) for o in one[4:]}) > 1  # the unseeded requests really sample


def test_tp2_processes_filtered_penalized_and_logprob_rows_exactly_as_tp1(tp1_and_tp2: tuple[LLM, LLM]) -> None:
    """Rows with filters, penalties, logit bias or logprobs need the whole vocabulary: the ranks all-gather
    those rows' slices (the vocabulary of 151669 splits unevenly: the last slice is padded) and each rank
    samples them itself, so TP=2 draws what TP=1 draws, and reports the same logprobs; plain rows in the
    same steps still exchange only candidates."""
    params = [
        SamplingParams(temperature=0.8, top_k=30, top_p=0.9, repetition_penalty=1.2, logprobs=3, seed=1, max_tokens=10,
                       ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3,
                       logit_bias={151000: 5.0, 7: -100.0}, seed=2, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, prompt_logprobs=2, logprobs=2, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=4, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, n=3, top_k=50, seed=5, max_tokens=8, ignore_eos=True),
    ]
    prompts = [TEXT_PROMPTS[i % len(TEXT_PROMPTS)] for i in range(len(params))]
    results = generate_at_tp1_and_tp2(tp1_and_tp2, prompts, params)
    for one, two in zip(*results):
        assert [s["token_ids"] for s in one["outputs"]] == [s["token_ids"] for s in two["outputs"]]
        for a, b in zip(one["outputs"], two["outputs"]):
            for x, y in zip(a["logprobs"] or [], b["logprobs"] or []):
                assert x["rank"] == y["rank"] and x["logprob"] == pytest.approx(y["logprob"], abs=1e-5)
                assert [t["token_id"] for t in x["top"]] == [t["token_id"] for t in y["top"]]
    # Prompt tokens of a random model sit mid-distribution, among neighbours closer than the last bits the
    # row-parallel sums change: their ranks may differ by a few.
    for x, y in zip(results[0][2]["prompt_logprobs"][1:], results[1][2]["prompt_logprobs"][1:]):
        assert abs(x["rank"] - y["rank"]) <= 3 and x["logprob"] == pytest.approx(y["logprob"], abs=1e-5)


def test_tp2_constrained_rows_draw_what_tp1_draws(tp1_and_tp2: tuple[LLM, LLM]) -> None:
    """Structured outputs under TP: every rank compiles each grammar and advances matchers of its own with the
    tokens it samples (the same on every rank), so every rank applies the same mask with no collective, and
    TP=2 gives TP=1's tokens, with unconstrained rows beside them."""
    import json as json_module

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["ok", "n"]}
    params = [SamplingParams(temperature=1.0, seed=1, max_tokens=40, structured_outputs={"json": schema}),
              SamplingParams(temperature=1.0, seed=2, max_tokens=20, structured_outputs={"regex": "[a-z]{3,6}"}),
              SamplingParams(temperature=0.0, max_tokens=10, structured_outputs={"choice": ["left", "right"]}),
              SamplingParams(temperature=0.7, seed=4, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.0, n=2, seed=5, max_tokens=40,
                             structured_outputs={"json": schema, "disable_any_whitespace": True})]
    prompts = [TEXT_PROMPTS[i % len(TEXT_PROMPTS)] for i in range(len(params))]
    results = generate_at_tp1_and_tp2(tp1_and_tp2, prompts, params)
    for one, two in zip(*results):
        assert [s["token_ids"] for s in one["outputs"]] == [s["token_ids"] for s in two["outputs"]]
    for sample in results[1][4]["outputs"]:
        if sample["finish_reason"] == "stop":
            assert set(json_module.loads(sample["text"])) == {"ok", "n"}
    assert results[1][2]["text"] in ("left", "right")
