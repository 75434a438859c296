"""The worker's GPU path: Triton and FlashAttention backends, CUDA graphs, bf16. Skipped without CUDA;
run them all on the device with `bash scripts/gpu_tests.sh`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.gpu_correctness import hf_reference
from common.config import EngineConfig
from common.protocol import NewRequest, SamplingOptions, StepPlan, i32
from deltaserve import SamplingParams
from tests.conftest import synthetic_prompt
from tests.test_engine_vs_hf import ID_PROMPTS, TEXT_PROMPTS, hf_greedy, prompt_ids

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
# Few graphs for a quick start-up, and a small cache: 90% of a big GPU is millions of blocks for a tiny
# model, and the tests' per-step invariant check walks every block.
SMALL = dict(max_num_seqs=16, cuda_graph_sizes=[1, 2, 4, 8, 16], kv_cache_memory_gb=1.0)


def _flash_available() -> bool:
    from workers.attention import flash_backend

    return flash_backend.usable(torch.device("cuda"), torch.bfloat16, 64, 16)


@pytest.fixture(scope="module")
def tiny_qwen3_hd64(tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_dir: Path) -> Path:
    """A tiny Qwen3 with head_dim 64, the smallest FlashAttention-4 runs."""
    from tests.conftest import make_tiny_checkpoint

    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("tiny-qwen3-hd64"), qwen3_tokenizer_dir,
                                hidden_size=128, head_dim=64)


BACKENDS = ["triton", pytest.param("flash-attn", marks=pytest.mark.skipif(not _flash_available(),
                                                                         reason="no FlashAttention installed"))]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_fp32_on_gpu_matches_transformers_exactly(tiny_qwen3: Path, engine_factory, enforce_eager: bool) -> None:
    llm = engine_factory(tiny_qwen3, device="cuda", dtype="float32", attention_backend="triton", block_size=16,
                         max_model_len=1024, max_num_batched_tokens=64, enforce_eager=enforce_eager, **SMALL)
    outputs = llm.generate(TEXT_PROMPTS + ID_PROMPTS, GREEDY, use_tqdm=False)
    for ids, out in zip(prompt_ids(tiny_qwen3), outputs):
        assert out["token_ids"] == hf_greedy(str(tiny_qwen3), tuple(ids))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [16, 256])
def test_bf16_backends_follow_transformers(tiny_qwen3_hd64: Path, engine_factory, backend: str,
                                           block_size: int) -> None:
    """In bf16 two correct implementations may break a near-tie differently (sums in another order),
    and every later token then differs. So: each prompt's tokens equal transformers' bf16 tokens, or at
    the first step where they differ, transformers' own logits rate our token within 2% of the largest
    logit of its choice (the first-step logit tolerance of issue 3)."""
    llm = engine_factory(tiny_qwen3_hd64, device="cuda", dtype="bfloat16", attention_backend=backend,
                         block_size=block_size, max_model_len=1024, max_num_batched_tokens=128, **SMALL)
    prompts = prompt_ids(tiny_qwen3_hd64)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    hf = hf_reference(str(tiny_qwen3_hd64), prompts, torch.bfloat16, "sdpa", "cuda", GREEDY.max_tokens)
    for ids, out, ref, ref_logits in zip(prompts, outputs, hf["tokens"], hf["logits"]):
        ours = out["token_ids"]
        if ours == ref:
            continue
        step = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
        logits = ref_logits[step]
        margin = (logits[ref[step]] - logits[ours[step]]).item()
        assert margin <= 2e-2 * logits.abs().max().item(), (len(ids), step, margin)


def _runner(model: Path, enforce_eager: bool, backend: str = "triton"):
    from workers.model_runner import ModelRunner

    cfg = EngineConfig(model=str(model), device="cuda", dtype="bfloat16", block_size=16, max_model_len=256,
                       max_num_seqs=8, cuda_graph_sizes=(4, 8), enforce_eager=enforce_eager,
                       attention_backend=backend).resolve()
    runner = ModelRunner(cfg, 0, "tcp://127.0.0.1:0")
    runner.allocate_kv_cache(64)
    runner.capture_cuda_graphs()
    return runner


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_graph_padding_rows_never_touch_real_requests(tiny_qwen3_hd64: Path, backend: str) -> None:
    """Decode at batch 3 replays the batch-4 graph. In one run the padding row's buffer entries are
    poisoned with a real request's block ids and a real position before every step: tokens and every
    real KV block must be bit-identical to a run without poison (same kernels, so no rounding excuse;
    eager mode would compare compiled with uncompiled element-wise kernels, which round differently)."""
    prompts = [synthetic_prompt(n, seed=n) for n in (20, 33, 47)]
    blocks = [[0, 1, 2, 3], [8, 9, 10, 11], [16, 17, 18, 19]]
    plans = [StepPlan(0, new_requests=[NewRequest(i, i32(p), 0.0, None, i32(b), 0, len(p))
                                       for i, (p, b) in enumerate(zip(prompts, blocks))])]
    plans += [StepPlan(s, decode_seq_ids=i32([0, 1, 2])) for s in range(1, 12)]
    results = {}
    for poisoned in (False, True):
        runner = _runner(tiny_qwen3_hd64, enforce_eager=False, backend=backend)
        assert runner.cuda_graphs.graphs, "graphs were not captured"
        tokens = []
        for plan in plans:
            if poisoned:  # everything a padding row could use points at request 0's blocks
                g = runner.cuda_graphs.graph_inputs
                with torch.inference_mode():  # the graph's buffers are inference tensors
                    g["block_tables"][3:, :4] = torch.tensor(blocks[0], dtype=torch.int32, device="cuda")
                    g["input_ids"][3:] = 12345
                    g["positions"][3:] = 40
            step = runner.execute(plan)
            tokens.append(runner.finalize(step).tolist())
            if plan.step_id > 0:
                assert step.timings["graph"] == 4
        cache = runner.kv_cache[:, :, sorted(sum(blocks, []))].float().cpu()
        results[poisoned] = (tokens, cache)
        del runner
        torch.cuda.empty_cache()
    assert results[True][0] == results[False][0]
    assert torch.equal(results[True][1], results[False][1]), "a padding row wrote into a real request's KV"


def test_batches_larger_than_the_largest_graph_run_eagerly(tiny_qwen3: Path) -> None:
    runner = _runner(tiny_qwen3, enforce_eager=False)
    prompts = [synthetic_prompt(8 + i, seed=i) for i in range(8)]  # one block each, with room to decode
    plan = StepPlan(0, new_requests=[NewRequest(i, i32(p), 0.0, None, i32([i]), 0, len(p))
                                     for i, p in enumerate(prompts)])
    runner.finalize(runner.execute(plan))
    runner.cuda_graphs.graphs.pop(8)  # only the batch-4 graph is left
    step = runner.execute(StepPlan(1, decode_seq_ids=i32(range(8))))
    tokens = runner.finalize(step)
    assert step.timings["graph"] == 0 and len(tokens) == 8 and np.all(tokens >= 0)


def test_kv_cache_is_sized_from_gpu_memory_utilization(tiny_qwen3: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The cache gets gpu_memory_utilization of the card less what this process's model needs and what other
    processes hold (the GPU tests share the card), then the MAX_KV_BLOCKS cap: the tiny model's 4 KiB blocks
    fill 20% of a big card with more blocks than the cap, so the room before the cap is what is checked."""
    import logging
    import re

    from workers.kv_cache import cap_kv_blocks
    from workers.model_runner import ModelRunner

    cfg = EngineConfig(model=str(tiny_qwen3), device="cuda", dtype="bfloat16", max_model_len=1024,
                       gpu_memory_utilization=0.2).resolve()
    runner = ModelRunner(cfg, 0, "tcp://127.0.0.1:0")
    with caplog.at_level(logging.INFO, logger="deltaserve.worker"):
        blocks = runner.max_num_kv_blocks()
    found = re.search(r"other (-?[\d.]+) GiB -> room for (\d+) KV blocks", caplog.text)
    assert found, caplog.text
    other, room = float(found.group(1)) * 2**30, int(found.group(2))
    total = torch.cuda.get_device_properties(0).total_memory
    budget = room * runner.kv_bytes_per_block
    # The tiny model's weights and peak activations are far below 1 GiB; the log rounds `other` to 0.01 GiB.
    assert 0.2 * total - other - 2**30 < budget <= 0.2 * total - other + 0.01 * 2**30
    assert blocks == cap_kv_blocks(room, cfg) > 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_no_triton_kernel_compiles_after_the_warm_up(tiny_qwen3: Path, engine_factory, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch, kv_cache_dtype: str) -> None:
    """Prompts of 1..400 tokens finishing at different lengths: prefill chunks, mixed steps and decode batches
    of many sizes. Every kernel variant they need was compiled before the engine reported ready (a variant
    compiled mid-run held its step 0.4-1.9 s on the H200); the worker counts compiles per step
    (workers/compile_watch.py)."""
    import json

    monkeypatch.setenv("DELTASERVE_STEP_LOG_DIR", str(tmp_path))
    llm = engine_factory(tiny_qwen3, device="cuda", dtype="bfloat16", attention_backend="triton",
                         max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=512, kv_cache_memory_gb=1.0,
                         kv_cache_dtype=kv_cache_dtype)
    rng = np.random.default_rng(0)
    lengths, max_tokens = rng.integers(1, 400, size=48), rng.integers(1, 120, size=48)
    prompts = [synthetic_prompt(int(n), seed=i) for i, n in enumerate(lengths)]
    # Every third request on the processed path (the fused processed-row sampler, eager and in its graphs).
    processed = [{}, {"top_p": 0.9, "logprobs": 3}, {}, {}, {"top_k": 20, "repetition_penalty": 1.2}, {}]
    params = [SamplingParams(temperature=float(t), max_tokens=int(m), ignore_eos=True, **processed[i % 6])
              for i, (t, m) in enumerate(zip(rng.choice([0.0, 0.7, 1.0], size=48), max_tokens))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outputs] == max_tokens.tolist()
    llm.shutdown()
    steps = [json.loads(line) for line in open(tmp_path / "worker-tp0.jsonl")]
    assert len({s["rows"] for s in steps if s.get("decode")}) >= 20  # many batch sizes were run
    assert sum(not s.get("decode") for s in steps) >= 10
    assert [(s["step"], s["rows"], s["tokens"], s["compiles"]) for s in steps if s.get("compiles")] == []


@pytest.mark.parametrize("batch", [1, 4, 8])
def test_sampling_in_the_decode_graph_draws_the_tokens_of_eager_sampling(tiny_qwen3: Path, batch: int) -> None:
    """A decode step of plain rows runs its LM head and sampler in a second graph (workers/graph_inputs.py);
    with the same seeds it must draw exactly the tokens the eager sampler draws (greedy, sampled and seeded rows;
    at a batch equal to a graph size the LM head multiplies the same rows either way). Also checks the token
    ids the forward graph gathers from `last_sampled` between pipelined steps."""
    from workers.model_runner import ModelRunner

    cfg = EngineConfig(model=str(tiny_qwen3), device="cuda", dtype="bfloat16", block_size=16, max_model_len=256,
                       max_num_seqs=8, cuda_graph_sizes=(1, 4, 8), attention_backend="triton").resolve()
    prompts = [synthetic_prompt(10 + 3 * i, seed=i) for i in range(batch)]
    temperatures = [(0.0, 0.8, 1.0, 1.3)[i % 4] for i in range(batch)]
    seeds = [7 if i % 3 == 1 else None for i in range(batch)]
    plans = [StepPlan(0, new_requests=[NewRequest(i, i32(p), temperatures[i], seeds[i], i32(range(8 * i, 8 * i + 8)),
                                                  0, len(p)) for i, p in enumerate(prompts)])]
    plans += [StepPlan(s, decode_seq_ids=i32(range(batch))) for s in range(1, 24)]
    results = {}
    for in_graph in (True, False):
        runner = ModelRunner(cfg, 0, "tcp://127.0.0.1:0")
        runner.allocate_kv_cache(64)
        runner.capture_cuda_graphs()
        assert set(runner.cuda_graphs.sample_graphs) == {1, 4, 8}
        if not in_graph:
            runner.cuda_graphs.sample_graphs.clear()
        tokens, pending = [], None
        for plan in plans:  # pipelined as the worker runs them: step N+1 launched before N is finalized
            step = runner.execute(plan)
            if pending is not None:
                tokens.append(runner.finalize(pending).tolist())
            pending = step
        tokens.append(runner.finalize(pending).tolist())
        results[in_graph] = tokens
        del runner
        torch.cuda.empty_cache()
    assert results[True] == results[False]
    assert len({tuple(t) for t in results[True]}) > 3  # the tokens move: the sampled ones are not stuck


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_processed_rows_sampled_in_the_graph_get_the_tokens_and_logprobs_of_eager_sampling(tiny_qwen3: Path,
                                                                                           batch: int) -> None:
    """A decode step with processed rows replays the processed-sampling graph (workers/sampling_graphs.py); with
    the same seeds it must give exactly the tokens and logprobs of the eager fused sampler, with the penalty state
    carried across steps alike (greedy, sampled, seeded, filtered, penalized and biased rows side by side)."""
    from workers.model_runner import ModelRunner

    cfg = EngineConfig(model=str(tiny_qwen3), device="cuda", dtype="bfloat16", block_size=16, max_model_len=256,
                       max_num_seqs=8, cuda_graph_sizes=(1, 4, 8), attention_backend="triton").resolve()
    options = [SamplingOptions(top_k=30, top_p=0.9, logprobs=3), None,
               SamplingOptions(repetition_penalty=1.3, frequency_penalty=0.4, logit_bias={5: 2.0}, logprobs=0),
               SamplingOptions(min_p=0.05, presence_penalty=0.5), SamplingOptions(logprobs=5)]
    prompts = [synthetic_prompt(10 + 3 * i, seed=i) for i in range(batch)]
    temperatures = [(0.0, 0.8, 1.0, 1.3)[i % 4] for i in range(batch)]
    seeds = [7 if i % 3 == 1 else None for i in range(batch)]
    plans = [StepPlan(0, new_requests=[NewRequest(i, i32(p), temperatures[i], seeds[i], i32(range(8 * i, 8 * i + 8)),
                                                  0, len(p), options[i % len(options)])
                                       for i, p in enumerate(prompts)])]
    plans += [StepPlan(s, decode_seq_ids=i32(range(batch))) for s in range(1, 24)]
    results = {}
    for in_graph in (True, False):
        runner = ModelRunner(cfg, 0, "tcp://127.0.0.1:0")
        runner.allocate_kv_cache(64)
        runner.capture_cuda_graphs()
        assert set(runner.cuda_graphs.processed_graphs) == {1, 4, 8}
        if not in_graph:
            runner.cuda_graphs.processed_graphs.clear()
        tokens, logprobs, pending = [], [], None
        for plan in plans:
            step = runner.execute(plan)
            if pending is not None:
                tokens.append(runner.finalize(pending).tolist())
                logprobs.append(pending.logprobs)
            pending = step
        tokens.append(runner.finalize(pending).tolist())
        logprobs.append(pending.logprobs)
        results[in_graph] = (tokens, logprobs)
        del runner
        torch.cuda.empty_cache()
    assert results[True][0] == results[False][0]
    for a, b in zip(results[True][1], results[False][1]):
        assert (a is None) == (b is None)
        if a is not None:
            assert all(np.array_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))


@pytest.mark.parametrize("batch", [1, 4])
def test_programmatic_dependent_launch_changes_no_bit(tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch,
                                                      batch: int) -> None:
    """DELTASERVE_PDL=1 (gpu_kernels/pdl.py) launches the decode kernels early, each waiting inside for the one before:
    the same arithmetic, so the same tokens and the same hidden states, in CUDA graphs (batch 1: the fused GEMVs)."""
    from gpu_kernels import pdl
    from workers.model_runner import ModelRunner

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    cfg = EngineConfig(model=str(tiny_qwen3), device="cuda", dtype="bfloat16", block_size=16, max_model_len=256,
                       max_num_seqs=4, cuda_graph_sizes=(1, 4), attention_backend="triton").resolve()
    prompts = [synthetic_prompt(40 + 9 * i, seed=i) for i in range(batch)]
    plans = [StepPlan(0, new_requests=[NewRequest(i, i32(p), 0.7, 3, i32(range(8 * i, 8 * i + 8)), 0, len(p))
                                       for i, p in enumerate(prompts)])]
    plans += [StepPlan(s, decode_seq_ids=i32(range(batch))) for s in range(1, 16)]
    results = {}
    for on in (False, True):
        monkeypatch.setenv("DELTASERVE_PDL", "1" if on else "0")
        pdl._requested.cache_clear()
        runner = ModelRunner(cfg, 0, "tcp://127.0.0.1:0")
        runner.allocate_kv_cache(64)
        runner.capture_cuda_graphs()
        tokens = [runner.finalize(runner.execute(plan)).tolist() for plan in plans]
        results[on] = (tokens, runner.cuda_graphs.graphs[batch][1][:batch].float().cpu(), runner.kv_cache.float().cpu())
        del runner
        torch.cuda.empty_cache()
    pdl._requested.cache_clear()
    assert results[True][0] == results[False][0]
    assert torch.equal(results[True][1], results[False][1]) and torch.equal(results[True][2], results[False][2])
