"""Request parameters on the GPU: the logits processing and the fused sampler on CUDA against the CPU path
and the numpy reference, and the engine with filters, penalties, logprobs and n > 1 (CUDA graphs on)
against transformers. Skipped without CUDA; `bash scripts/gpu_tests.sh` runs them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from common.protocol import SamplingOptions
from deltaserve import SamplingParams
from tests.conftest import synthetic_prompt
from tests.test_engine_vs_hf import hf_greedy
from tests.test_logits_processing import distinct_logits, ref_filters, ref_penalties, softmax, state
from tests.test_sampling_engine import hf_log_softmax
from workers.logits_processing import LogitsProcessor, build_processing
from workers.sampler import ProcessedRows, Sampler

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CUDA = torch.device("cuda")
VOCAB = 151936  # Qwen3-0.6B's LM head
SMALL = dict(max_num_seqs=16, cuda_graph_sizes=[1, 2, 4, 8, 16], kv_cache_memory_gb=1.0)


def process_on(device: torch.device, states, logits: torch.Tensor):
    temps = np.array([st.temperature for st in states], np.float32)
    inputs = build_processing(states, temps, logits.shape[1])
    proc = LogitsProcessor(device, max_num_seqs=max(16, len(states)), vocab_size=logits.shape[1])
    proc.penalties.reset_rows([st for st in states if st.penalized])
    d = proc.upload(inputs)
    x = logits.to(device)[d.i["rows"]].float().clone()
    return proc.apply(x, d, torch.zeros(proc.penalties.max_num_seqs, dtype=torch.int64, device=device)), d, proc


SPECS = [dict(top_k=50, top_p=0.9), dict(top_p=0.95), dict(min_p=0.05), dict(top_k=2000, top_p=0.8, min_p=0.01),
         dict(top_k=1), dict(repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.3, top_k=50),
         dict(logit_bias={5: 100.0, 6: -100.0}, bad_words=[[7], [8, 9]], min_tokens=4, stop_token_ids=[10, 11])]


def test_cuda_processing_matches_the_cpu_path_and_the_reference_at_full_vocabulary() -> None:
    logits = distinct_logits(len(SPECS), seed=1, vocab=VOCAB)
    prompt, output = [1, 2, 3, 8], [8, 12, 12]
    states = [state(i, SamplingOptions(**spec), prompt=prompt, output=output, temperature=0.8)
              for i, spec in enumerate(SPECS)]
    gpu, _, _ = process_on(CUDA, states, logits)
    cpu, _, _ = process_on(torch.device("cpu"), states, logits)
    gpu = gpu.cpu()
    for row, spec in enumerate(SPECS):
        assert torch.equal(torch.isfinite(gpu[row]), torch.isfinite(cpu[row])), spec
        np.testing.assert_allclose(softmax(gpu[row].double().numpy()), softmax(cpu[row].double().numpy()), atol=1e-6)
        if not ({"repetition_penalty", "logit_bias"} & set(spec)):
            ref = ref_filters(logits[row].double().numpy() / 0.8, k=spec.get("top_k", 0), p=spec.get("top_p", 1.0),
                              m=spec.get("min_p", 0.0))
            assert np.array_equal(np.isfinite(gpu[row].numpy()), np.isfinite(ref)), spec
    ref = ref_penalties(logits[5].numpy(), prompt, output, 1.1, 0.5, 0.3) / 0.8
    assert np.array_equal(np.isfinite(gpu[5].numpy()), np.isfinite(ref_filters(ref, k=50)))


def test_bf16_logits_with_many_ties_keep_every_token_tied_with_the_k_th() -> None:
    logits = distinct_logits(4, seed=2, vocab=VOCAB).to(torch.bfloat16).float()  # bf16 values tie a lot
    states = [state(i, SamplingOptions(top_k=50, top_p=0.9)) for i in range(4)]
    gpu, _, _ = process_on(CUDA, states, logits)
    for row in range(4):
        ref = ref_filters(logits[row].double().numpy(), k=50, p=0.9)
        assert np.array_equal(np.isfinite(gpu[row].cpu().numpy()), np.isfinite(ref))


def test_the_fused_kernel_draws_filtered_rows_from_their_kept_tokens_in_proportion() -> None:
    logits = distinct_logits(1, seed=3, vocab=VOCAB, scale=2.5)
    spec = dict(top_k=30, top_p=0.9)
    rows = 2048
    states = [state(i, SamplingOptions(**spec)) for i in range(rows)]
    batch = logits.expand(rows, -1).contiguous()
    counts = np.zeros(VOCAB, np.int64)
    sampler = Sampler(CUDA, seed=5)
    for _ in range(16):
        x, d, _ = process_on(CUDA, states, batch)
        tokens = sampler(batch.to(CUDA), torch.ones(rows, device=CUDA), False, None,
                         ProcessedRows(d.i["rows"], d.host.rows, x, d.f["sample_temperatures"], True))
        counts += np.bincount(tokens.cpu().numpy(), minlength=VOCAB)
    ref = ref_filters(logits[0].double().numpy(), k=30, p=0.9)
    assert counts[~np.isfinite(ref)].sum() == 0
    kept = np.isfinite(ref)
    expected = softmax(ref)[kept] * counts.sum()
    statistic = ((counts[kept] - expected) ** 2 / expected).sum()
    from tests.test_logits_processing import chi2_survival

    assert chi2_survival(float(statistic), int(kept.sum()) - 1) > 1e-3


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_fp32_logprobs_prompt_logprobs_and_samples_on_gpu_match_transformers(tiny_qwen3: Path, engine_factory,
                                                                             enforce_eager: bool) -> None:
    llm = engine_factory(tiny_qwen3, device="cuda", dtype="float32", attention_backend="triton", block_size=16,
                         max_model_len=512, enforce_eager=enforce_eager, **SMALL)
    prompt = synthetic_prompt(37, seed=4)
    greedy, samples = llm.generate([prompt, prompt], [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=3),
        SamplingParams(temperature=0.0, n=4, max_tokens=8, ignore_eos=True)], use_tqdm=False)
    expected = hf_greedy(str(tiny_qwen3), tuple(prompt))[:8]
    assert greedy["token_ids"] == expected
    assert all(s["token_ids"] == expected for s in samples["outputs"])  # the forks' copied block holds the right KV
    lsm = hf_log_softmax(str(tiny_qwen3), tuple(prompt + expected))
    for i, entry in enumerate(greedy["outputs"][0]["logprobs"]):
        assert entry["logprob"] == pytest.approx(lsm[len(prompt) - 1 + i, expected[i]].item(), abs=1e-4)
    for position in range(1, len(prompt)):
        entry = greedy["prompt_logprobs"][position]
        assert entry["logprob"] == pytest.approx(lsm[position - 1, prompt[position]].item(), abs=1e-4)


def test_seeded_filtered_requests_on_gpu_do_not_depend_on_the_batch(tiny_qwen3: Path, engine_factory) -> None:
    llm = engine_factory(tiny_qwen3, device="cuda", dtype="float32", attention_backend="triton", block_size=16,
                         max_model_len=512, **SMALL)
    prompts = [synthetic_prompt(20 + i, seed=10 + i) for i in range(4)]
    params = [SamplingParams(temperature=0.9, top_k=50, top_p=0.9, repetition_penalty=1.1, logprobs=5, seed=i,
                             max_tokens=16, ignore_eos=True) for i in range(4)]
    alone = [llm.generate([p], sp, use_tqdm=False)[0]["token_ids"] for p, sp in zip(prompts, params)]
    fillers = [synthetic_prompt(30, seed=s) for s in range(6)]
    together = llm.generate(fillers + prompts, [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 6
                            + params, use_tqdm=False)[6:]
    assert [o["token_ids"] for o in together] == alone


def test_after_the_warm_up_no_batch_size_compiles_a_sampling_kernel() -> None:
    import triton

    from gpu_kernels.sampling import compile_for_batches

    compile_for_batches(256, VOCAB, torch.bfloat16, CUDA)
    compiled: list[str] = []

    def hook(*_, **kwargs):
        compiled.append(str(kwargs.get("fn")))
        return False

    saved = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        sampler = Sampler(CUDA, seed=0)
        for rows in range(1, 257):
            logits = torch.randn(rows, VOCAB, device=CUDA).to(torch.bfloat16)
            sampler(logits, torch.full((rows,), 0.8, device=CUDA), all_greedy=False)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_post_compile_hook = saved
    assert compiled == []
