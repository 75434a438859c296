"""Deterministic mode (issue 34; workers/deterministic.py): a request's tokens and logprobs are bitwise the same
whatever else is in its batch, on the CPU torch path.

The engine tests run the trained demo model (SmolLM2-135M-Instruct): 16 prompts each alone, then inside batches with
random neighbours at random places, with prefix-cache hits, with prompts prefilled in chunks of a few tokens and with
requests preempted and recomputed; greedy and seeded T=1 (top_p 0.95) requests; every token id and every logprob
(the sampled token's and its top 5) must be identical, not close.
"""

from __future__ import annotations

import random

import pytest
import torch

from common.config import ConfigError, EngineConfig
from deltaserve import LLM, SamplingParams
from frontend.default_model import ensure_default_model
from workers import deterministic as det

NUM_PROMPTS = 16
MAX_TOKENS = 32


# ============================================================================ the pieces
def test_attend_per_query_gives_a_query_the_same_bits_in_any_chunk_and_alone() -> None:
    torch.manual_seed(0)
    seq_len = 70
    q, keys, values = (torch.randn(seq_len, 4, 16) for _ in range(3))
    whole = det.attend_per_query(q, keys, values, 0.25)
    for n in (1, 7, 64):  # the last n tokens as one chunk (n = 1: a decode step)
        assert torch.equal(det.attend_per_query(q[seq_len - n:], keys, values, 0.25), whole[seq_len - n:])
    # the same sequence prefilled in chunks of 1, 7 and 64 tokens, each chunk over the context so far
    for size in (1, 7, 64):
        parts = [det.attend_per_query(q[a: a + size], keys[: min(a + size, seq_len)], values[: min(a + size, seq_len)],
                                      0.25) for a in range(0, seq_len, size)]
        assert torch.equal(torch.cat(parts), whole)
    # a query computed earlier, when the context ended at its own position (a recompute after preemption)
    for pos in (0, 20, 33):
        alone = det.attend_per_query(q[pos: pos + 1], keys[: pos + 1], values[: pos + 1], 0.25)
        assert torch.equal(alone[0], whole[pos])
    reference = torch.stack([torch.softmax((keys[: p + 1] * q[p]).sum(-1).T * 0.25, -1)[..., None].mul(
        values[: p + 1].transpose(0, 1)).sum(1) for p in range(seq_len)]).double()
    assert torch.allclose(whole.double(), reference, atol=1e-5)


@pytest.mark.parametrize("reduce", [lambda t: torch.logsumexp(t, dim=-1), lambda t: t.double().sum(dim=-1)])
def test_row_reduce_gives_a_row_the_same_bits_among_any_neighbours(reduce, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(det, "_enabled", True)
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(1, 151_669, generator=gen) * 4
    alone = det.row_reduce(row, reduce)
    for neighbours in (1, 2, 5, 16):
        batch = torch.randn(neighbours + 1, 151_669, generator=gen) * 4
        at = int(torch.randint(0, neighbours + 1, (1,), generator=gen))
        batch[at] = row[0]
        assert torch.equal(det.row_reduce(batch, reduce)[at], alone[0])
    assert det.row_reduce(torch.zeros(0, 8), reduce).shape == (0,)


def test_deterministic_must_be_a_bool(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="deterministic must be true or false"):
        EngineConfig(model=str(tmp_path), deterministic="yes")


# ============================================================================ the engine
def _prompts(rng: random.Random, n: int, low: int = 4, high: int = 60) -> list[list[int]]:
    return [[rng.randrange(200, 40000) for _ in range(rng.randint(low, high))] for _ in range(n)]


def _params(i: int) -> SamplingParams:
    """Even requests greedy, odd ones seeded T=1 with top_p 0.95; all with top-5 logprobs."""
    if i % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    return SamplingParams(temperature=1.0, top_p=0.95, seed=1000 + i, max_tokens=MAX_TOKENS, ignore_eos=True,
                          logprobs=5)


def _bits(out: dict) -> tuple:
    """A result's token ids and every logprob it reports (token and top entries), for exact comparison."""
    sample = out["outputs"][0]
    assert out["error"] is None, out["error"]
    return (tuple(sample["token_ids"]),
            tuple((e["token_id"], e["logprob"], e["rank"], tuple((t["token_id"], t["logprob"]) for t in e["top"]))
                  for e in sample["logprobs"]))


def _in_batch(llm: LLM, prompts: list[list[int]], rng: random.Random, neighbours: int) -> tuple[list[tuple], int]:
    """Every prompt inside one batch with `neighbours` random requests (greedy and sampled) at random places;
    the results of `prompts` in their order, and the preemptions of the whole batch."""
    others = _prompts(rng, neighbours, 2, 90)
    batch = [(p, _params(i)) for i, p in enumerate(prompts)] + [
        (p, SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(1, 40), ignore_eos=True,
                           logprobs=rng.choice([None, 2]))) for p in others]
    order = list(range(len(batch)))
    rng.shuffle(order)
    outs = llm.generate([batch[j][0] for j in order], [batch[j][1] for j in order], use_tqdm=False)
    by_index = {j: out for j, out in zip(order, outs)}
    preemptions = sum(out["metrics"].get("num_preemptions", 0) for out in outs)
    return [_bits(by_index[i]) for i in range(len(prompts))], preemptions


@pytest.fixture(scope="module")
def demo_model() -> str:
    return ensure_default_model(verbose=False)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(34)
    base = _prompts(rng, NUM_PROMPTS - 4)
    # four that share a prefix with earlier ones (prefix-cache hits inside one batch)
    return base + [base[i][: 40] + extra for i, extra in zip(range(4), _prompts(rng, 4, 3, 12))]


@pytest.fixture(scope="module")
def alone(demo_model: str, prompts: list[list[int]]) -> list[tuple]:
    """Each prompt alone, on an engine without prefix caching: the reference."""
    llm = LLM(demo_model, device="cpu", deterministic=True, enable_prefix_caching=False, max_model_len=512)
    try:
        assert llm.client.engine_info().info["deterministic"] is True
        return [_bits(llm.generate([p], _params(i), use_tqdm=False)[0]) for i, p in enumerate(prompts)]
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_requests_get_the_same_bits_alone_and_in_batches_with_prefix_cache_hits(
        demo_model: str, prompts: list[list[int]], alone: list[tuple]) -> None:
    rng = random.Random(7)
    llm = LLM(demo_model, device="cpu", deterministic=True, max_model_len=512)
    try:
        got, _ = _in_batch(llm, prompts, rng, 7)
        assert got == alone, "with 7 neighbours"
        # the same prompts again among more neighbours: their full blocks now come from the prefix cache
        got, _ = _in_batch(llm, prompts, rng, 16)
        assert got == alone, "served from the prefix cache"
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_requests_get_the_same_bits_prefilled_in_chunks_and_after_preemption(
        demo_model: str, prompts: list[list[int]], alone: list[tuple]) -> None:
    rng = random.Random(11)
    # chunks of at most 13 tokens across the whole batch, and a KV cache of 24 blocks of 16 tokens for 24 requests
    # of up to ~120 tokens each: requests are preempted and recomputed; the scheduler plans two steps ahead of the
    # results (blocks freed and reused, preemptions and finishes with two steps in flight)
    llm = LLM(demo_model, device="cpu", deterministic=True, max_model_len=512, max_num_batched_tokens=13,
              num_kvcache_blocks=24, max_steps_in_flight=3)
    try:
        assert llm.client.engine_info().info["max_steps_in_flight"] == 3
        got, preemptions = _in_batch(llm, prompts, rng, 8)
        assert preemptions > 0, "the KV cache was meant to force preemptions"
        assert got == alone
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_the_default_mode_is_not_batch_invariant_on_this_model(demo_model: str, prompts: list[list[int]],
                                                              alone: list[tuple]) -> None:
    """Why the mode exists: without it, the same requests in a batch get other logprob bits (so this test's
    comparisons can fail). Four of the prompts are enough to show it."""
    llm = LLM(demo_model, device="cpu", max_model_len=512)
    try:
        got, _ = _in_batch(llm, prompts[:4], random.Random(7), 7)
    finally:
        llm.shutdown()
    assert got != alone[:4]


# ============================================================================ the GPU path, on CPU
def _tiny_bits(llm: LLM, prompts: list[list[int]], neighbours: list[list[int]] | None = None) -> list[tuple]:
    """Greedy and seeded results of `prompts` (with top-3 logprobs), each alone or, with `neighbours`, all in one
    batch with them in front."""
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, seed=i, max_tokens=8, ignore_eos=True,
                             logprobs=3) for i in range(len(prompts))]
    if neighbours is None:
        return [_bits(llm.generate([p], sp, use_tqdm=False)[0]) for p, sp in zip(prompts, params)]
    filler = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(neighbours + prompts, [filler] * len(neighbours) + params, use_tqdm=False)
    return [_bits(o) for o in outs[len(neighbours):]]


def test_triton_attention_gives_the_same_bits_in_decode_and_in_any_prefill_chunk(
        tiny_qwen3, engine_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU path's attention (gpu_kernels/deterministic_attention.py for every token, decode rows too), run by the
    Triton interpreter through the engine: requests alone, then among neighbours with prompts
    prefilled in 5-token chunks. The interpreter's per-row numpy products cannot show a GPU's batch variance (the
    default kernels pass this too): this checks the path runs and agrees with itself; tests/test_gpu_deterministic.py
    checks the bits on a GPU."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rng = random.Random(3)
    prompts = _prompts(rng, 2, 6, 30)  # one greedy, one seeded
    llm = engine_factory(tiny_qwen3, attention_backend="triton", deterministic=True, max_model_len=256,
                         enable_prefix_caching=False)
    alone_bits = _tiny_bits(llm, prompts)
    chunked = engine_factory(tiny_qwen3, attention_backend="triton", deterministic=True, max_model_len=256,
                             max_num_batched_tokens=5)
    assert _tiny_bits(chunked, prompts, _prompts(rng, 3, 2, 20)) == alone_bits


def test_the_mode_is_refused_where_it_cannot_hold(tiny_qwen3) -> None:
    with pytest.raises(ConfigError, match=r"tensor_parallel_size \(--tensor-parallel-size\) 1 or 2"):
        EngineConfig(model=str(tiny_qwen3), deterministic=True, tensor_parallel_size=4)
    with pytest.raises(ConfigError, match="torch \\(CPU\\) or triton \\(GPU\\) attention backend"):
        EngineConfig(model=str(tiny_qwen3), deterministic=True, attention_backend="flash-attn")


def test_the_sampler_keeps_its_own_chunk_size_outside_deterministic_mode_and_off_a_gpu() -> None:
    """`sampling_chunk_size` fixes the fused sampler's vocabulary chunk only in deterministic mode on a GPU (its
    value there is checked by tests/test_gpu_deterministic.py's engine runs); None lets the sampler choose."""
    saved = det.deterministic()
    try:
        det.set_deterministic(False)
        assert det.sampling_chunk_size(151936, 256, torch.device("cpu")) is None
        det.set_deterministic(True)
        assert det.sampling_chunk_size(151936, 256, torch.device("cpu")) is None
    finally:
        det.set_deterministic(saved)
