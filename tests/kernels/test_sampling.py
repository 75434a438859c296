"""The fused sampling kernel (gpu_kernels/sampling.py) against softmax(logits / T) and argmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
from gpu_kernels.sampling import (  # noqa: E402
    choose_chunk_size,
    chunk_size_representatives,
    compile_for_batches,
    sample_candidates,
    sample_tokens,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Chi-square critical values at p = 0.001 for the degrees of freedom used below.
CHI2_CRITICAL_P001 = {9: 27.88, 49: 85.35}
# The interpreter runs one program per row on the CPU: keep its sample small there.
VOCAB, DRAWS = (50, 4000) if DEVICE == "cuda" else (10, 600)


def test_greedy_rows_take_the_first_argmax() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.5, -1.0, 7.0, 7.0]], device=DEVICE)
    out = sample_tokens(logits, torch.zeros(2, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE))
    assert out.tolist() == [1, 2]


def test_nan_and_masked_entries_never_win() -> None:
    logits = torch.tensor([[float("nan"), float("-inf"), 0.0, -3.0],
                           [float("-inf"), float("-inf"), float("-inf"), 5.0]], device=DEVICE)
    for t in (0.0, 1.0, 3.0):
        for seed in range(5):
            out = sample_tokens(logits, torch.full((2,), t, device=DEVICE), torch.full((2,), seed, device=DEVICE))
            assert out[0].item() in (2, 3) and out[1].item() == 3


_MASK32 = 0xFFFF_FFFF


def philox4x32_10(counters: np.ndarray, seed: int) -> np.ndarray:
    """Reference Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011)
    of the counters (c, 0, 0, 0) under the key (seed low word, seed high word): `[4, len(counters)]` uint32."""
    c = [counters.astype(np.uint64), np.zeros_like(counters, np.uint64), np.zeros_like(counters, np.uint64),
         np.zeros_like(counters, np.uint64)]
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(10):
        p0, p1 = np.uint64(0xCD9E8D57) * c[2], np.uint64(0xD2511F53) * c[0]
        c = [(p0 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p0 & np.uint64(_MASK32),
             (p1 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1), p1 & np.uint64(_MASK32)]
        k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
    return np.stack(c).astype(np.uint32)


def reference_gumbel(global_index: np.ndarray, seed: int) -> np.ndarray:
    """The noise the kernel must add to entry g: word g % 4 of the Philox output for counter g // 4,
    as a uniform in [0, 1) (31 bits, Triton's uint_to_uniform_float), then -log(-log(max(u, 1e-20)))."""
    bits = philox4x32_10(global_index // 4, seed)[global_index % 4, np.arange(len(global_index))].view(np.int32)
    u = np.where(bits < 0, ~bits, bits).astype(np.float32) * np.float32(4.6566127342e-10)
    return -np.log(-np.log(np.maximum(u, np.float32(1e-20))))


def test_reference_philox_matches_the_published_known_answers() -> None:
    # Random123's kat_vectors for philox4x32_10: counter 0 and key 0.
    assert philox4x32_10(np.array([0]), 0)[:, 0].tolist() == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


@pytest.mark.parametrize("vocab_offset", [0, 3, 4, 1001])
def test_noise_of_entry_g_is_word_g_mod_4_of_philox_counter_g_div_4(vocab_offset: int) -> None:
    """Row k keeps only entry k finite (logit 0, temperature 1), so its score is the noise of global entry
    vocab_offset + k: it must be the reference noise for every chunk size (16 leaves tiles that straddle
    the chunks' 4-entry groups when the offset is unaligned)."""
    width = 12
    logits = torch.full((width, width), float("-inf"))
    logits.fill_diagonal_(0.0)
    logits = logits.to(DEVICE)
    for seed in (0, 2**40 + 12345):  # a seed above 2**32 exercises the key's high word
        seeds = torch.full((width,), seed, dtype=torch.int64, device=DEVICE)
        expected = reference_gumbel(np.arange(vocab_offset, vocab_offset + width), seed)
        for chunk_size in (16, None):
            scores, tokens = sample_candidates(logits, torch.ones(width, device=DEVICE), seeds,
                                               vocab_offset=vocab_offset, chunk_size=chunk_size)
            assert tokens.tolist() == list(range(vocab_offset, vocab_offset + width))
            np.testing.assert_allclose(scores.cpu().numpy(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("split", [3, 4, 1001])
def test_two_slices_split_at_any_point_pick_the_whole_vocabulary_token(split: int) -> None:
    """Tensor parallelism with slices that need not start at a multiple of 4: the best candidate of
    [0, split) and [split, vocab) is the token of the whole vocabulary, at every chunk size."""
    torch.manual_seed(8)
    vocab, n = 1200, 6
    logits = (torch.randn(n, vocab) * 0.5).to(DEVICE)  # flat: the winner can lie anywhere
    temps = torch.tensor([1.0, 0.6, 0.0, 2.0, 1.0, 0.9], device=DEVICE)
    seeds = (torch.arange(n, dtype=torch.int64) * 104729 + 1).to(DEVICE)
    whole = sample_tokens(logits, temps, seeds)
    for chunk_size in (64, None):
        parts = [sample_candidates(logits[:, :split], temps, seeds, chunk_size=chunk_size),
                 sample_candidates(logits[:, split:], temps, seeds, vocab_offset=split, chunk_size=chunk_size)]
        scores, tokens = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
        best = scores.argmax(dim=0, keepdim=True)  # first maximum: the lower slice
        assert torch.equal(tokens.gather(0, best).squeeze(0), whole), chunk_size
    assert whole[2].item() == logits[2].argmax().item()


def test_greedy_rows_of_a_mixed_batch_take_the_first_argmax_whatever_their_seed() -> None:
    torch.manual_seed(9)
    logits = torch.randint(-3, 4, (6, 200)).float().to(DEVICE)  # few values: many exact ties
    temps = torch.tensor([0.0, 1.0, 0.0, 0.7, 0.0, 0.0], device=DEVICE)
    greedy = (temps == 0).nonzero().squeeze(1)
    first_argmax = logits.argmax(-1)  # torch returns the first maximal index
    for seed in (0, 77, 2**50):
        seeds = torch.full((6,), seed, dtype=torch.int64, device=DEVICE)
        for chunk_size in (16, 64, None):
            scores, tokens = sample_candidates(logits, temps, seeds, chunk_size=chunk_size)
            assert torch.equal(tokens[greedy], first_argmax[greedy])
            assert torch.equal(scores[greedy], logits[greedy].max(-1).values)  # no noise added


def test_the_default_chunk_size_fills_the_gpu_at_batch_1_and_amortises_at_batch_256() -> None:
    assert choose_chunk_size(256, 151936, 132) == 8192  # 19 chunks a row, 4864 programs
    assert choose_chunk_size(1, 151936, 132) == 512  # 297 programs rather than 19
    assert choose_chunk_size(8, 151936, 132) == 4096
    assert choose_chunk_size(1, 300, 132) == 512  # no smaller than a block of 512, none larger than the slice
    assert choose_chunk_size(4, 10, 1) == 16


def test_the_warm_up_batches_cover_every_chunk_size_once_at_its_smallest_batch() -> None:
    reps = chunk_size_representatives(256, 151936, 132)
    assert reps == [1, 2, 4, 7, 14]  # chunks of 512, 1024, 2048, 4096, 8192
    sizes = [choose_chunk_size(rows, 151936, 132) for rows in reps]
    assert sorted(set(sizes)) == sorted(sizes) == sorted({choose_chunk_size(r, 151936, 132) for r in range(1, 257)})
    for rows in range(1, 257):
        first = min(r for r in range(1, rows + 1) if choose_chunk_size(r, 151936, 132) == choose_chunk_size(
            rows, 151936, 132))
        assert first in reps


def test_the_warm_up_runs_the_sampler_at_each_representative_batch() -> None:
    compile_for_batches(3, 300, torch.float32, torch.device("cpu"), vocab_offset=5)  # must not raise


@pytest.mark.parametrize(("temperature", "vocab_offset"), [(0.6, 0), (1.7, 3)])
def test_samples_follow_softmax_of_scaled_logits(temperature: float, vocab_offset: int) -> None:
    torch.manual_seed(3)
    vocab, n = VOCAB, DRAWS
    row = torch.randn(vocab) * 2
    logits = row.repeat(n, 1).to(DEVICE)
    seeds = (torch.arange(n, dtype=torch.int64) * 7919 + 11).to(DEVICE)
    temps = torch.full((n,), temperature, device=DEVICE)
    out = sample_candidates(logits, temps, seeds, vocab_offset=vocab_offset)[1].cpu() - vocab_offset
    expected = torch.softmax(row.double() / temperature, -1) * n
    counts = torch.bincount(out, minlength=vocab).double()
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < CHI2_CRITICAL_P001[vocab - 1], chi2


def test_same_seed_same_token_and_bf16_logits() -> None:
    logits = torch.randn(8, 3000, device=DEVICE).to(torch.bfloat16 if DEVICE == "cuda" else torch.float32)
    temps = torch.ones(8, device=DEVICE)
    seeds = torch.arange(8, dtype=torch.int64, device=DEVICE)
    a, b = sample_tokens(logits, temps, seeds), sample_tokens(logits, temps, seeds)
    assert torch.equal(a, b)
    c = sample_tokens(logits, temps, seeds + 1000)
    assert not torch.equal(a, c)
    assert torch.equal(sample_tokens(logits, torch.zeros(8, device=DEVICE), seeds), logits.float().argmax(-1))


@pytest.mark.parametrize("vocab", [10, 37, 300])
def test_token_does_not_depend_on_the_chunk_size(vocab: int) -> None:
    # 37 and 300 leave a partial last chunk for every chunk size below; 10 fits in one chunk.
    torch.manual_seed(5)
    logits = (torch.randn(6, vocab) * 3).to(DEVICE)
    logits[1, ::4] = float("-inf")
    logits[2, 1::3] = float("nan")
    temps = torch.tensor([0.0, 0.5, 1.0, 1.7, 0.0, 3.0], device=DEVICE)
    seeds = (torch.arange(6, dtype=torch.int64) * 977 + 5).to(DEVICE)
    whole_row = sample_tokens(logits, temps, seeds, chunk_size=512)
    for chunk_size in (16, 32, 64, 128, None):
        assert torch.equal(sample_tokens(logits, temps, seeds, chunk_size=chunk_size), whole_row), chunk_size
    assert torch.equal(whole_row[[0, 4]], logits[[0, 4]].argmax(-1))


def test_ties_across_chunks_take_the_lowest_index() -> None:
    logits = torch.zeros(3, 64, device=DEVICE)
    logits[0, [40, 20, 63]] = 5.0  # best in chunks 1, 2 and 3 of 16 entries
    logits[1, [15, 16]] = 5.0  # either side of the first chunk boundary
    logits[2, :] = float("-inf")
    logits[2, [17, 48]] = float("inf")  # an infinite score ties even with Gumbel noise added
    temps = torch.tensor([0.0, 0.0, 1.0], device=DEVICE)
    seeds = torch.arange(3, dtype=torch.int64, device=DEVICE)
    assert sample_tokens(logits, temps, seeds, chunk_size=16).tolist() == [20, 15, 17]


def test_partial_last_chunk_and_vocab_smaller_than_a_chunk() -> None:
    logits = torch.zeros(4, 50, device=DEVICE)
    logits[0, 49] = 1.0  # in the last chunk, which holds only entries 48 and 49
    logits[1, 48] = 1.0
    logits[2, :] = float("nan")  # nothing can win in any chunk
    logits[3, 3] = 1.0
    temps, seeds = torch.zeros(4, device=DEVICE), torch.zeros(4, dtype=torch.int64, device=DEVICE)
    assert sample_tokens(logits, temps, seeds, chunk_size=16).tolist() == [49, 48, 0, 3]
    assert sample_tokens(logits, temps, seeds, chunk_size=64).tolist() == [49, 48, 0, 3]
    assert sample_tokens(logits[:, :5], temps, seeds, chunk_size=16).tolist() == [0, 0, 0, 3]


@pytest.mark.parametrize("splits", [(0, 37, 300), (0, 150, 151, 300), (0, 16, 100, 240, 300)])
def test_vocabulary_slices_pick_the_whole_vocabulary_token(splits: tuple[int, ...]) -> None:
    """Tensor parallelism: each rank scores its slice with noise keyed by the global index; the best
    (score, token) over the slices, ties to the lowest slice, is the whole-vocabulary token."""
    torch.manual_seed(6)
    logits = (torch.randn(8, 300) * 2).to(DEVICE)
    logits[1, 150:] = float("-inf")  # the winner must come from the first half
    logits[2, :] = float("-inf")
    logits[2, [149, 151]] = 4.0  # a greedy tie across the middle boundary: the lower id wins
    logits[3, 200:] = float("nan")
    temps = torch.tensor([0.0, 0.8, 0.0, 1.0, 0.6, 1.5, 0.0, 1.0], device=DEVICE)
    seeds = (torch.arange(8, dtype=torch.int64) * 131 + 7).to(DEVICE)
    whole = sample_tokens(logits, temps, seeds)
    scores, tokens = zip(*[sample_candidates(logits[:, a:b], temps, seeds, vocab_offset=a, chunk_size=16)
                           for a, b in zip(splits, splits[1:])])
    best = torch.stack(scores).argmax(dim=0, keepdim=True)  # first maximum: the lowest slice
    assert torch.equal(torch.stack(tokens).gather(0, best).squeeze(0), whole)
    assert whole[2].item() == 149


def test_candidates_give_global_ids_and_their_scores() -> None:
    logits = torch.tensor([[0.0, 2.5, 1.0], [float("-inf")] * 3], device=DEVICE)
    scores, tokens = sample_candidates(logits, torch.zeros(2, device=DEVICE),
                                       torch.zeros(2, dtype=torch.int64, device=DEVICE), vocab_offset=1000)
    assert tokens.tolist() == [1001, 1000] and scores.tolist() == [2.5, float("-inf")]
    with pytest.raises(ValueError, match="vocab_offset"):
        sample_candidates(logits, torch.zeros(2, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE),
                          vocab_offset=-1)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError):
        sample_tokens(torch.zeros(3, device=DEVICE), torch.zeros(3, device=DEVICE),
                      torch.zeros(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError):
        sample_tokens(torch.zeros(2, 5, device=DEVICE), torch.zeros(3, device=DEVICE),
                      torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError):
        sample_tokens(torch.zeros(2, 5, device=DEVICE), torch.zeros(2, device=DEVICE),
                      torch.zeros(2, dtype=torch.int64, device=DEVICE), chunk_size=24)


def test_rows_processed_by_the_filters_sample_only_their_kept_tokens_in_proportion() -> None:
    """The fused kernel on logits that workers/logits_processing.py filtered (temperature applied, dropped
    tokens at -inf), at temperature 1: what the engine does with processed rows."""
    import numpy as np

    from common.protocol import SamplingOptions
    from workers.logits_processing import LogitsProcessor, build_processing
    from workers.request_state import ReqState

    torch.manual_seed(7)
    vocab, n = (50, 4000) if DEVICE == "cuda" else (12, 600)
    row = torch.randn(vocab) * 1.5
    states = []
    for i in range(n):
        st = ReqState(i, 0.8, None, SamplingOptions(top_k=5, top_p=0.95))
        st.row, st.tokens, st.num_tokens, st.num_tokens_cpu, st.num_prompt_tokens = i, np.zeros(4, np.int32), 1, 1, 1
        states.append(st)
    proc = LogitsProcessor(torch.device(DEVICE), n, vocab)
    d = proc.upload(build_processing(states, np.full(n, 0.8, np.float32), vocab))
    x = proc.apply(row.repeat(n, 1).to(DEVICE), d, torch.zeros(n, dtype=torch.int64, device=DEVICE))
    seeds = (torch.arange(n, dtype=torch.int64) * 7919 + 3).to(DEVICE)
    out = sample_tokens(x, torch.ones(n, device=DEVICE), seeds).cpu()
    kept = torch.isfinite(x[0]).cpu()
    assert 2 <= int(kept.sum()) <= 5 and kept[out].all(), "drew a token the filters removed"
    expected = torch.softmax(x[0].cpu().double(), -1)[kept] * n
    counts = torch.bincount(out, minlength=vocab).double()[kept]
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}[int(kept.sum()) - 1], chi2  # p = 0.001


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="real-size compiled kernel: needs a CUDA GPU")
@pytest.mark.parametrize("batch", [256, 1])
def test_real_size_slices_and_greedy_rows_on_the_gpu(batch: int) -> None:
    """Qwen3's vocabulary in bf16 at the engine's batch sizes (the default chunk is 8192 at batch 256 and
    512 at batch 1): two slices split at an unaligned point pick the whole-vocabulary token, and the
    greedy rows of a mixed batch are torch's argmax."""
    vocab, split = 151936, 75971
    torch.manual_seed(10)
    logits = (torch.randn(batch, vocab, device="cuda") * 3).to(torch.bfloat16)
    temps = torch.full((batch,), 0.6, device="cuda")
    temps[1::3] = 0.0
    seeds = torch.randint(0, 2**62, (batch,), device="cuda")
    whole = sample_tokens(logits, temps, seeds)
    parts = [sample_candidates(logits[:, :split], temps, seeds),
             sample_candidates(logits[:, split:], temps, seeds, vocab_offset=split)]
    scores, tokens = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    assert torch.equal(tokens.gather(0, scores.argmax(dim=0, keepdim=True)).squeeze(0), whole)
    assert torch.equal(whole[1::3], logits[1::3].float().argmax(-1))
    assert torch.equal(sample_tokens(logits, temps, seeds, chunk_size=2048), whole)
