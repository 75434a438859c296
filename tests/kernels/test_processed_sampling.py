"""The processed-row sampler (gpu_kernels/processed_sampling.py) against its numpy reference
(gpu_kernels/processed_sampling_reference.py), against sample_candidates for plain rows, and against
workers/logits_processing.py for the processing semantics.

Under the Triton interpreter every program runs in Python (~0.1-0.4 s a processed row), so the vocabularies are
small and the batches few; the chunk and tile sizes are chosen so that rows span several chunks and tiles.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
from gpu_kernels.processed_sampling import (  # noqa: E402
    BLOCK,
    SEG1,
    ProcessedSample,
    ProcessedSamplingWorkspace,
    compile_for_batches,
    processed_chunk_representatives,
    processed_sample,
)
from gpu_kernels.processed_sampling_reference import (  # noqa: E402
    ReferenceSample,
    gumbel_log_terms,
    reference_processed_sample,
)
from gpu_kernels.sampling import sample_candidates  # noqa: E402
from gpu_kernels.sampling_inputs import (  # noqa: E402
    BAN_ALWAYS,
    BAN_NONE,
    PenaltyBits,
    ProcessedParams,
    SparseEntries,
    from_processing,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Chi-square quantiles at p = 0.001 (upper tail) for 1..10 degrees of freedom.
_CHI2_P001 = (10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877, 29.588)


def chi2_critical_p001(df: int) -> float:
    """The chi-square value exceeded with probability 0.001: the table, or Wilson and Hilferty's cube
    approximation (1931) beyond 10 degrees of freedom."""
    if df <= len(_CHI2_P001):
        return _CHI2_P001[df - 1]
    z = 3.090232  # the standard normal's 0.999 quantile
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def workspace(vocab: int, **kwargs) -> ProcessedSamplingWorkspace:
    """Small buffers (fast under the interpreter) unless a test asks otherwise."""
    options = {"tile_size": 64, "threshold_capacity": 128, "top_capacity": 64, "max_scratch_rows": 8} | kwargs
    return ProcessedSamplingWorkspace(DEVICE, vocab, **options)


def bf16_logits(rows: int, vocab: int, seed: int, scale: float = 2.5) -> torch.Tensor:
    """Random logits rounded to bf16 (8 mantissa bits: many exact ties), in bf16."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * scale).to(torch.bfloat16).to(DEVICE)


def run(logits: torch.Tensor, params: ProcessedParams, seeds: torch.Tensor, ws: ProcessedSamplingWorkspace,
        chunk_size: int | None = None, num_top: int = 5, **inputs) -> tuple[ProcessedSample, ReferenceSample]:
    out = processed_sample(logits, params, seeds, workspace=ws, num_top=num_top, chunk_size=chunk_size, **inputs)
    return out, reference_processed_sample(logits, params, seeds, num_top=num_top, **inputs)


def kept_by(out: ProcessedSample, ref: ReferenceSample) -> np.ndarray:
    """The kernel's kept sets `[n, V]`: the finite processed logits at or above its thresholds."""
    return (ref.y > -np.inf) & (ref.y >= out.thresholds.cpu().numpy()[:, None])


def assert_matches(out: ProcessedSample, ref: ReferenceSample) -> None:
    bad = np.flatnonzero((kept_by(out, ref) != ref.kept).any(axis=1))
    assert not len(bad), f"kept sets differ in rows {bad.tolist()} (sizes {ref.kept.sum(1)[bad].tolist()})"
    np.testing.assert_array_equal(out.tokens.cpu().numpy(), ref.tokens)
    np.testing.assert_array_equal(out.ranks.cpu().numpy(), ref.ranks)
    np.testing.assert_array_equal(out.top_ids.cpu().numpy(), ref.top_ids)
    for got, want in ((out.logprobs.cpu().numpy(), ref.logprobs), (out.top_logprobs.cpu().numpy(), ref.top_logprobs)):
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=1e-3)
    assert not out.flags.any(), out.flags


FILTER_ROWS = {  # temperature, top_k, top_p, min_p, logprobs: every combination of the filters
    "plain": (0.9, 0, 1.0, 0.0, -1), "greedy": (0.0, 0, 1.0, 0.0, -1), "greedy+logprobs": (0.0, 0, 1.0, 0.0, 5),
    "logprobs only": (1.0, 0, 1.0, 0.0, 3), "top-k": (0.8, 7, 1.0, 0.0, 5), "top-p": (1.2, 0, 0.8, 0.0, 0),
    "min-p": (1.0, 0, 1.0, 0.05, 4), "top-k+top-p": (0.7, 40, 0.9, 0.0, 5), "top-k+min-p": (1.0, 25, 1.0, 0.1, 2),
    "top-p+min-p": (0.9, 0, 0.95, 0.02, 5), "all three": (1.1, 60, 0.85, 0.01, 5),
    "large top-k+top-p": (1.0, 500, 0.9, 0.0, 1), "flat top-p": (3.0, 0, 0.97, 0.0, 2),
    "tiny top-p": (1.0, 0, 1e-6, 0.0, 5), "min-p 1": (1.0, 0, 1.0, 1.0, 5),
    "greedy with filters": (0.0, 5, 0.5, 0.5, 3),
}


def filter_params(vocab: int, rows: dict[str, tuple] = FILTER_ROWS) -> ProcessedParams:
    t, k, p, m, n = (np.array(c) for c in zip(*rows.values()))
    return ProcessedParams.from_arrays(t, vocab, DEVICE, top_k=k, top_p=p, min_p=m, num_logprobs=n)


def test_the_outputs_share_one_buffer_without_overlapping_so_one_copy_takes_them_to_the_host() -> None:
    out = ProcessedSample.carve(None, 3, 5)
    # Each field starts 16-byte aligned: 24 (+8) + 24 (+8) + 120 (+8) + 12 (+4) + 60 (+4) + 12 (+4) + 12
    assert out.packed.numel() == ProcessedSample.nbytes(3, 5) == 32 + 32 + 128 + 16 + 64 + 16 + 12
    out.packed.zero_()
    fields = [out.tokens, out.ranks, out.top_ids, out.logprobs, out.top_logprobs, out.thresholds, out.flags]
    for value, field in enumerate(fields, start=1):
        field.fill_(value)
    for value, field in enumerate(fields, start=1):
        assert (field == value).all() and field.untyped_storage().data_ptr() == out.packed.data_ptr()
    again = ProcessedSample.carve(out.packed.clone(), 3, 5)  # another buffer of the same layout reads the same
    assert torch.equal(again.top_ids, out.top_ids) and torch.equal(again.flags, out.flags)
    assert out.to_host() is out  # on a CPU the outputs are already on the host
    assert (out.top_logprobs.shape, out.top_ids.dtype, out.flags.dtype) == ((3, 5), torch.int64, torch.int32)
    for n in (1, 3, 7, 64, 255):  # whatever the batch, every field 16-byte aligned (Triton's pointer specialization)
        carved = ProcessedSample.carve(None, n, 20)
        assert all((field.data_ptr() - carved.packed.data_ptr()) % 16 == 0
                   for field in (carved.tokens, carved.ranks, carved.top_ids, carved.logprobs, carved.top_logprobs,
                                 carved.thresholds, carved.flags))


@pytest.mark.parametrize("seed", [0, 1])
def test_every_filter_combination_matches_the_reference(seed: int) -> None:
    """bf16 logits (ties everywhere) over 4 chunks of 4 tiles, one row per combination of filters: the same
    kept set, token, rank and top-N ids, logprobs within 1e-3; `large top-k+top-p` takes more than a buffer
    (its top-k set is found exactly first, then top-p), `flat top-p` keeps most of the vocabulary."""
    vocab = 777
    logits = bf16_logits(len(FILTER_ROWS), vocab, seed)
    logits[12] = logits[12] * 0.1  # the flat row
    seeds = torch.arange(len(FILTER_ROWS), dtype=torch.int64, device=DEVICE) * 7919 + seed
    # Six passes: the top-k set of `large top-k+top-p` exceeds the 128-entry buffer, so its top-k threshold is
    # narrowed to a single value before the top-p search starts (with the default 4 passes it would be rounded).
    out, ref = run(logits, filter_params(vocab), seeds, workspace(vocab, num_passes=6), chunk_size=256)
    assert_matches(out, ref)
    sizes = dict(zip(FILTER_ROWS, ref.kept.sum(1)))
    assert sizes["top-k"] >= 7 and sizes["large top-k+top-p"] < 500 and sizes["flat top-p"] > 500
    for name in ("tiny top-p", "min-p 1"):  # the top value only, with its ties
        r = list(FILTER_ROWS).index(name)
        np.testing.assert_array_equal(ref.kept[r], ref.y[r] == ref.y[r].max())


def test_float32_logits_and_a_top_k_above_the_finite_count() -> None:
    """fp32 logits (all distinct) and a row with 20 finite entries whose top-k is 50: every finite token stays."""
    vocab = 600
    logits = (torch.randn(4, vocab, generator=torch.Generator().manual_seed(3)) * 2).to(DEVICE)
    logits[1, 20:] = float("-inf")
    params = ProcessedParams.from_arrays(np.array([0.8, 1.0, 1.0, 0.5]), vocab, DEVICE, top_k=np.array([10, 50, 0, 3]),
                                         top_p=np.array([0.9, 1.0, 0.6, 1.0]), num_logprobs=np.array([5, 5, 2, 0]))
    out, ref = run(logits, params, torch.tensor([5, 6, 7, 8], device=DEVICE), workspace(vocab), chunk_size=128)
    assert_matches(out, ref)
    assert ref.kept[1].sum() == 20


PENALTY_ENTRIES = {"bias_rows": [0, 0, 1, 4, 4, 6], "bias_tokens": [5, 5, 17, 3, 250, 9],
                   "bias_values": [2.0, 1.5, 30.0, -5.0, 4.0, 3.0], "ban_rows": [0, 4, 4, 6, 6, 7],
                   "ban_tokens": [11, 3, 40, 9, 9, 2], "ban_after": [-1, 42, 7, 1, 2, -1]}


def entries_of(rows: list[int]) -> dict[str, list]:
    """PENALTY_ENTRIES of the given rows, renumbered 0, 1, ... in that order."""
    out: dict[str, list] = {name: [] for name in PENALTY_ENTRIES}
    for kind, fields in (("bias", ("tokens", "values")), ("ban", ("tokens", "after"))):
        for i, r in enumerate(PENALTY_ENTRIES[f"{kind}_rows"]):
            if r in rows:
                out[f"{kind}_rows"].append(rows.index(r))
                for f in fields:
                    out[f"{kind}_{f}"].append(PENALTY_ENTRIES[f"{kind}_{f}"][i])
    return out


def penalty_case(vocab: int = 300) -> tuple[torch.Tensor, ProcessedParams, torch.Tensor, dict]:
    """Rows with repetition/frequency/presence penalties (from seen and generated tokens), a grammar mask,
    logit bias (two entries for one token add up), unconditional bans and bans conditional on the last sampled
    token, on greedy and sampled rows with and without filters."""
    rng = np.random.default_rng(4)
    n = 8
    logits = bf16_logits(n, vocab, 5, scale=2.0)
    penalties = PenaltyBits(DEVICE, 6, vocab)
    prompts = [rng.integers(0, vocab, 25) for _ in range(5)]
    penalties.reset_rows_from_tokens(range(5), prompts, [p[15:] for p in prompts])
    bitmask = torch.from_numpy(rng.integers(-2**31, 2**31, (2, triton.cdiv(vocab, 32))).astype(np.int32)).to(DEVICE)
    sparse = SparseEntries.from_lists(n, DEVICE, **entries_of(list(range(n))))
    params = ProcessedParams.from_arrays(
        np.array([0.8, 1.0, 0.0, 1.0, 0.9, 0.0, 1.0, 1.3]), vocab, DEVICE,
        top_k=np.array([20, 0, 0, 8, 0, 0, 4, 0]), top_p=np.array([0.9, 0.7, 1, 1, 0.95, 1, 0.8, 1]),
        min_p=np.array([0, 0.1, 0, 0, 0, 0, 0, 0]), repetition=np.array([1.2, 1, 1.5, 1.3, 1.1, 1, 1, 1]),
        frequency=np.array([0.5, 0, 0, 0, 0.3, 0, 0.2, 0]), presence=np.array([0, 0, 0, 0.5, 0.4, 0, 1.0, 0]),
        state_rows=np.array([0, -1, 1, 2, 3, -1, 4, -1]), grammar_rows=np.array([0, -1, 1, -1, -1, 0, -1, -1]),
        scratch_rows=sparse.scratch_rows, num_logprobs=np.array([5, 3, 4, -1, 1, 2, -1, 0]))
    last = torch.tensor([0, 0, 42, 9, 2, 0], dtype=torch.int64, device=DEVICE)
    seeds = torch.arange(n, dtype=torch.int64, device=DEVICE) * 13 + 5
    return logits, params, seeds, {"penalties": penalties, "bitmask": bitmask, "sparse": sparse, "last_sampled": last}


def test_penalties_bias_bans_and_grammar_match_the_reference() -> None:
    logits, params, seeds, inputs = penalty_case()
    out, ref = run(logits, params, seeds, workspace(logits.shape[1]), chunk_size=128, **inputs)
    assert_matches(out, ref)
    y = ref.y
    assert y[0, 11] == -np.inf and y[6, 9] == -np.inf and y[7, 2] == -np.inf  # bans; row 6's last token is 2
    assert y[4, 3] > -np.inf  # row 4's ban of token 3 waits for a last token of 42, and it was 2
    assert out.tokens[1].item() == 17  # a bias of +30 wins


def test_nan_never_wins_and_a_row_without_finite_logits_gets_token_0() -> None:
    vocab = 200
    logits = bf16_logits(4, vocab, 6).float()
    logits[0, ::2] = float("nan")
    logits[1] = float("-inf")
    logits[2, [30, 170]] = float("inf")  # ties at the top: the first index, greedy or sampled
    logits[3] = float("nan")
    params = ProcessedParams.from_arrays(np.array([1.0, 1.0, 0.7, 0.0]), vocab, DEVICE, top_k=np.array([5, 3, 2, 0]),
                                         top_p=np.array([0.9, 1, 0.5, 1]), num_logprobs=np.array([3, 3, 2, 4]))
    out, ref = run(logits, params, torch.tensor([1, 2, 3, 4], device=DEVICE), workspace(vocab), chunk_size=64)
    assert_matches(out, ref)
    assert out.tokens[0].item() % 2 == 1 and out.tokens[1].item() == 0 and out.tokens[2].item() == 30
    assert out.logprobs[1].item() == -float("inf") and out.ranks[1].item() == 1
    assert out.top_ids[1].tolist() == [0, 1, 2, 3, 4] and out.top_ids[3, :4].tolist() == [0, 1, 2, 3]


def test_plain_rows_get_the_tokens_of_sample_candidates() -> None:
    """Temperature-only rows run sampling.py's own scan: the same token for the same seed, also when the
    batch holds processed rows and at any chunk size."""
    vocab, n = 500, 24
    logits = bf16_logits(n, vocab, 7)
    temps = np.where(np.arange(n) % 4 == 0, 0.0, 0.4 + 0.1 * (np.arange(n) % 7)).astype(np.float32)
    top_k = np.where(np.arange(n) % 5 == 3, 10, 0)  # rows 3, 8, 13, ... are processed
    params = ProcessedParams.from_arrays(temps, vocab, DEVICE, top_k=top_k)
    seeds = torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    plain = top_k == 0
    want = sample_candidates(logits, torch.from_numpy(temps).to(DEVICE), seeds)[1].cpu().numpy()
    for chunk_size in (128, None):
        got = processed_sample(logits, params, seeds, workspace=workspace(vocab), chunk_size=chunk_size).tokens
        np.testing.assert_array_equal(got.cpu().numpy()[plain], want[plain])


def test_any_chunk_and_tile_size_gives_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three tilings, chunkings and buffer sizes, and a fourth whose chunk-wide loops (prepare, with its loads one
    block ahead; the dense sample and rank) take several blocks: the same results. With the 512-entry buffer the
    top-k 300 row collects its ~300-entry upper set and sorts it at the full size (above the 256 of the usual
    brackets)."""
    vocab = 700
    rows = {name: FILTER_ROWS[name] for name in ("top-k", "all three", "greedy+logprobs", "flat top-p")} | {
        "top-k 300+top-p": (1.0, 300, 0.9, 0, 2)}
    logits = bf16_logits(len(rows), vocab, 9)
    params = filter_params(vocab, rows)
    seeds = torch.arange(len(rows), dtype=torch.int64, device=DEVICE) + 100
    results = []
    for tile, chunk, cap, block in ((32, 64, 128, None), (64, 1024, 128, None), (128, 256, 512, None),
                                    (64, 1024, 128, 128)):
        if block is not None:
            for kernel in ("prepare", "sample", "rank"):
                monkeypatch.setitem(BLOCK, kernel, block)
        ws = workspace(vocab, tile_size=tile, threshold_capacity=cap, num_passes=6)
        results.append(run(logits, params, seeds, ws, chunk_size=chunk))
    for out, ref in results:
        assert_matches(out, ref)
    first = results[0][0]
    for other, _ in results[1:]:
        for name in ("tokens", "ranks", "top_ids"):
            assert torch.equal(getattr(other, name), getattr(first, name)), name
        torch.testing.assert_close(other.logprobs, first.logprobs, rtol=0, atol=1e-5)


def test_each_row_gets_the_same_result_alone_as_in_a_mixed_batch() -> None:
    logits, params, seeds, inputs = penalty_case()
    batch = processed_sample(logits, params, seeds, workspace=workspace(300), num_top=5, **inputs)
    for r in (0, 2, 4, 6, 7):
        alone = ProcessedParams(params.floats[r: r + 1], params.ints[r: r + 1])
        sparse = SparseEntries.from_lists(1, DEVICE, **entries_of([r]))
        out = processed_sample(logits[r: r + 1], alone, seeds[r: r + 1], workspace=workspace(300), num_top=5,
                               **(inputs | {"sparse": sparse}))
        for name in ("tokens", "ranks", "top_ids", "thresholds"):
            assert torch.equal(getattr(out, name)[0], getattr(batch, name)[r]), (r, name)
        torch.testing.assert_close(out.logprobs[0], batch.logprobs[r], rtol=0, atol=1e-6)


def test_tied_tokens_are_kept_together_and_the_top_n_takes_their_lowest_ids() -> None:
    """150 tokens tie at the top, more than either buffer: top-k 5 keeps all 150 (the bracket narrows to the
    single value), top-p keeps or drops a tie group whole (two tied tokens above the rest hold 98% of the mass:
    top-p 0.3 keeps both), and the top 5 are the five lowest ids of the tie."""
    vocab = 1000
    logits = torch.zeros(3, vocab)
    ties = torch.randperm(vocab, generator=torch.Generator().manual_seed(10))[:150]
    logits[:, ties] = 4.0
    logits[:, 7] = -1.0
    logits[2, ties[:2]] = 12.0
    params = ProcessedParams.from_arrays(np.array([1.0, 1.0, 1.0]), vocab, DEVICE, top_k=np.array([5, 0, 0]),
                                         top_p=np.array([1.0, 0.5, 0.3]), num_logprobs=np.array([5, 5, 5]))
    out, ref = run(logits.to(DEVICE), params, torch.tensor([1, 2, 3], device=DEVICE),
                   workspace(vocab, threshold_capacity=64), chunk_size=256)
    assert_matches(out, ref)
    assert ref.kept[0].sum() == 150 and ref.kept[1].sum() == 150 and ref.kept[2].sum() == 2
    assert out.top_ids[0].tolist() == sorted(ties.tolist())[:5]
    assert sorted(out.top_ids[2, :2].tolist()) == sorted(ties[:2].tolist())


def test_an_overfull_bracket_is_kept_whole_flagged_and_counted() -> None:
    """One pass cannot separate 395 distinct values packed just below five tied maxima (all in 7 tiles, so the
    8th largest tile max, 0, bounds the top 8 from below): the top-8 threshold is rounded down to its bracket
    (a superset of the exact set; flag 1), the top-N list keeps the five maxima exactly and then the lowest
    indices of the bracket (flag 2), and the workspace counts the row once."""
    vocab = 1024
    logits = torch.zeros(2, vocab)
    logits[:, 320:720] = 9.0 + torch.randperm(400, generator=torch.Generator().manual_seed(11)).float() * 1e-4
    logits[:, 330:335] = 10.0
    params = ProcessedParams.from_arrays(np.array([1.0, 1.0]), vocab, DEVICE, top_k=np.array([8, 0]),
                                         num_logprobs=np.array([8, -1]))
    ws = workspace(vocab, num_passes=1, threshold_capacity=64)
    out, ref = run(logits.to(DEVICE), params, torch.tensor([1, 2], device=DEVICE), ws, chunk_size=256, num_top=8)
    kept = kept_by(out, ref)
    assert out.flags.tolist() == [3, 0] and ws.overflow_count.item() == 1
    assert ref.kept[0].sum() == 8 and (kept[0] >= ref.kept[0]).all() and kept[0].sum() == 400
    assert kept[0, out.tokens[0].item()]
    assert out.top_ids[0, :5].tolist() == list(range(330, 335))
    np.testing.assert_array_equal(out.tokens[1:].cpu().numpy(), ref.tokens[1:])


DISTRIBUTIONS = {"top-k": (4, 1.0, 0.0), "top-p": (0, 0.7, 0.0), "min-p": (0, 1.0, 0.15),
                 "top-k+top-p+min-p": (6, 0.9, 0.05)}
_DIST_LOGITS = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.9, 0.5, 0.2, 0.0, -0.3, -1.0, -2.0, 1.45, 0.7, -0.5, 0.1, -4.0])


def truncated_softmax(y: np.ndarray, kept: np.ndarray) -> np.ndarray:
    p = np.where(kept, np.exp(y.astype(np.float64) - y.max()), 0.0)
    return p / p.sum()


def chi2(counts: np.ndarray, probs: np.ndarray, draws: int) -> tuple[float, int]:
    kept = probs > 0
    assert counts[~kept].sum() == 0, "drew a token outside the kept set"
    expected = probs[kept] * draws
    return float((((counts[kept] - expected) ** 2) / expected).sum()), int(kept.sum()) - 1


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_the_reference_draws_follow_the_truncated_renormalised_softmax(name: str) -> None:
    """20,000 fresh seeds through the reference sampler, whose tokens the kernel reproduces seed for seed
    (the tests above): a chi-square test at p = 0.001 against the filtered, renormalised softmax."""
    k, p, m = DISTRIBUTIONS[name]
    vocab, draws = len(_DIST_LOGITS), 20_000
    params = ProcessedParams.from_arrays(np.array([0.8]), vocab, "cpu", top_k=np.array([k]), top_p=np.array([p]),
                                         min_p=np.array([m]))
    ref = reference_processed_sample(_DIST_LOGITS[None], params, torch.zeros(1, dtype=torch.int64))
    y, kept = ref.y[0], ref.kept[0]
    assert 2 <= kept.sum() < vocab
    seeds = np.random.default_rng(12).integers(0, 2**62, draws)
    tokens = np.argmax(np.where(kept, y - gumbel_log_terms(vocab, seeds), -np.inf), axis=1)
    stat, df = chi2(np.bincount(tokens, minlength=vocab), truncated_softmax(y, kept), draws)
    assert stat < chi2_critical_p001(df), (stat, df)


def test_kernel_draws_follow_the_truncated_renormalised_softmax() -> None:
    """Fresh seeds straight through the kernel (20,000 on a GPU; 48 under the interpreter, where a processed
    row costs ~0.4 s: there it shows only gross errors), for all three filters at once."""
    k, p, m = DISTRIBUTIONS["top-k+top-p+min-p"]
    vocab = len(_DIST_LOGITS)
    draws = 20_000 if DEVICE == "cuda" else 48
    params = ProcessedParams.from_arrays(np.full(draws, 0.8), vocab, DEVICE, top_k=np.full(draws, k),
                                         top_p=np.full(draws, p), min_p=np.full(draws, m))
    seeds = torch.from_numpy(np.random.default_rng(13).integers(0, 2**62, draws)).to(DEVICE)
    out = processed_sample(_DIST_LOGITS.repeat(draws, 1).to(DEVICE), params, seeds,
                           workspace=workspace(vocab, tile_size=16))
    first = ProcessedParams(params.floats[:1].cpu(), params.ints[:1].cpu())
    ref = reference_processed_sample(_DIST_LOGITS[None], first, seeds[:1].cpu())
    tokens = out.tokens.cpu().numpy()
    stat, df = chi2(np.bincount(tokens, minlength=vocab), truncated_softmax(ref.y[0], ref.kept[0]), draws)
    assert stat < chi2_critical_p001(df), (stat, df)


def test_penalty_bits_reset_record_and_copy() -> None:
    vocab = 70
    bits = PenaltyBits(DEVICE, 4, vocab)
    bits.reset_rows_from_tokens([1, 3], [np.array([0, 5, 69, 5]), np.array([33])], [np.array([5, 69]), np.array([])])
    # A column of a packed table, as the worker passes ProcessedParams.ints[:, I_STATE_ROW] (stride 8).
    table = torch.zeros(4, 8, dtype=torch.int32, device=DEVICE)
    table[:, 1] = torch.tensor([1, -1, 3, 1], dtype=torch.int32)
    bits.record(table[:, 1], torch.tensor([5, 9, 40, 64], dtype=torch.int64, device=DEVICE))
    bits.copy_rows([1], [2])
    seen, output, counts = (t.cpu() for t in bits.tensors())

    def ids(words: torch.Tensor) -> list[int]:
        return [t for t in range(vocab) if (int(words[t // 32]) >> (t % 32)) & 1]

    assert ids(seen[1]) == ids(seen[2]) == [0, 5, 64, 69] and ids(seen[3]) == [33, 40] and ids(seen[0]) == []
    assert ids(output[1]) == [5, 64, 69] and ids(output[3]) == [40]
    assert counts[1, 5].item() == 2 and counts[1, 69].item() == 1 and counts[1, 64].item() == 1
    assert counts[3].sum().item() == 1 and torch.equal(counts[2], counts[1])


def test_sparse_entries_merge_biases_and_ban_conditions() -> None:
    e = SparseEntries.from_lists(4, "cpu", bias_rows=[2, 2, 0], bias_tokens=[9, 9, 4], bias_values=[1.0, 0.5, -2.0],
                                 ban_rows=[2, 2, 2, 3, 3], ban_tokens=[9, 9, 7, 1, 1], ban_after=[5, 6, -1, 3, -1])
    assert e.offsets.tolist() == [0, 1, 1, 4, 5]
    assert e.tokens.tolist() == [4, 7, 9, 9, 1]
    assert e.bias.tolist() == [-2.0, 0.0, 1.5, 1.5, 0.0]
    assert e.ban_after.tolist() == [BAN_NONE, BAN_ALWAYS, 5, 6, BAN_ALWAYS]
    assert e.scratch_rows.tolist() == [0, -1, 1, 2]


@pytest.mark.parametrize("block", [None, 64])
def test_the_step_inputs_give_what_workers_logits_processing_gives(block: int | None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """From build_processing's ProcessingInputs (penalties, bias, bad words, min_tokens, filters, logprobs):
    the kept tokens, their processed logits and the logprobs of workers/logits_processing.py. Temperature 0.5
    and repetition 2 have exact reciprocals, so the kernels' multiplications equal its divisions. With `block` 64
    the chunk-wide loops take two blocks a chunk (prepare's loads one block ahead, for every source of y)."""
    if block is not None:
        for kernel in ("prepare", "sample", "rank"):
            monkeypatch.setitem(BLOCK, kernel, block)
    from common.protocol import SamplingOptions
    from workers.input_batch import ReqState
    from workers.logits_processing import LogitsProcessor, build_processing, token_logprobs

    vocab = 300
    options = [SamplingOptions(top_k=12, top_p=0.9, repetition_penalty=2.0, logprobs=3),
               SamplingOptions(top_p=0.8, frequency_penalty=0.5, presence_penalty=0.25, logit_bias={7: 5.0}),
               SamplingOptions(min_p=0.1, bad_words=[[3, 4], [8]], min_tokens=9, stop_token_ids=[1, 2], logprobs=2),
               None, SamplingOptions(logprobs=0),
               SamplingOptions(top_k=20, frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0,
                               logprobs=4)]  # penalties without sparse entries: the whole pipeline on the logits
    temps = np.array([0.5, 1.0, 0.5, 0.7, 0.0, 0.5], np.float32)
    rng = np.random.default_rng(14)
    states = []
    for i, o in enumerate(options):
        st = ReqState(i, float(temps[i]), None, o)
        st.row, st.num_prompt_tokens = i, 10
        st.tokens = rng.integers(0, vocab, 16).astype(np.int32)
        st.tokens[15] = 3  # the output ends in 3: bad word [3, 4] bans 4
        st.num_tokens = st.num_tokens_cpu = 16
        states.append(st)
    h = build_processing(states, temps, vocab)
    proc = LogitsProcessor(torch.device("cpu"), len(states), vocab)
    proc.penalties.reset_rows([st for st in states if st.penalized])
    logits = bf16_logits(len(states), vocab, 15).cpu().float()
    last = torch.zeros(len(states), dtype=torch.int64)
    today = proc.apply(logits[h.rows].clone(), proc.upload(h), last)
    params, sparse = from_processing(h, temps, vocab, DEVICE)
    bits = PenaltyBits(DEVICE, len(states), vocab)
    bits.reset_rows([st for st in states if st.penalized])
    seeds = torch.arange(len(states), dtype=torch.int64, device=DEVICE)
    out, ref = run(logits.to(DEVICE), params, seeds, workspace(vocab), chunk_size=128, num_top=3, penalties=bits,
                   sparse=sparse, last_sampled=last.to(DEVICE))
    assert_matches(out, ref)
    rows = h.rows
    np.testing.assert_array_equal(ref.kept[rows], torch.isfinite(today).numpy())
    np.testing.assert_array_equal(np.where(ref.kept[rows], ref.y[rows], 0), torch.where(torch.isfinite(today), today,
                                                                                          0).numpy())
    asked = np.flatnonzero([o is not None and o.logprobs >= 0 for o in options])
    lp, rank, top_lp, top_ids = token_logprobs(today[np.searchsorted(rows, asked)], out.tokens[asked].cpu(), 3)
    torch.testing.assert_close(out.logprobs[asked].cpu(), lp, rtol=0, atol=1e-3)
    assert torch.equal(out.ranks[asked].cpu(), rank)


def test_the_warm_up_covers_every_chunk_size_once() -> None:
    assert processed_chunk_representatives(256, 151936, 132) == [1, 7, 14]  # chunks of 2048, 4096, 8192
    compile_for_batches(3, torch.float32, workspace(300), num_top=2)  # must not raise


def test_bad_inputs_are_refused() -> None:
    vocab = 64
    logits = torch.zeros(2, vocab, device=DEVICE)
    seeds = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    plain = ProcessedParams.from_arrays(np.ones(2), vocab, DEVICE)
    with pytest.raises(ValueError, match="rows"):
        processed_sample(logits, plain, seeds[:1])
    with pytest.raises(ValueError, match="num_top"):
        processed_sample(logits, plain, seeds, num_top=SEG1 + 1)
    with pytest.raises(ValueError, match="chunk_size"):
        processed_sample(logits, plain, seeds, workspace=workspace(vocab), chunk_size=48)
    with pytest.raises(ValueError, match="grammar"):
        processed_sample(logits, ProcessedParams.from_arrays(np.ones(2), vocab, DEVICE, grammar_rows=np.array([0, -1])),
                         seeds)
    with pytest.raises(ValueError, match="PenaltyBits"):
        processed_sample(logits, ProcessedParams.from_arrays(np.ones(2), vocab, DEVICE, repetition=np.array([1.1, 1]),
                                                             state_rows=np.array([0, 1])), seeds)
    with pytest.raises(ValueError, match="top_p"):
        ProcessedParams.from_arrays(np.ones(2), vocab, DEVICE, top_p=np.array([1.5, 1.0]))
    with pytest.raises(ValueError, match="vocabulary"):
        processed_sample(logits, plain, seeds, workspace=workspace(vocab + 1))


def real_vocabulary_batch(batch: int, vocab: int, seed: int) -> tuple[torch.Tensor, ProcessedParams, torch.Tensor]:
    """`batch` rows on the GPU cycling through every row type of FILTER_ROWS: bf16 logits, parameters, seeds."""
    names = list(FILTER_ROWS)
    rows = {f"{names[i % len(names)]} {i}": FILTER_ROWS[names[i % len(names)]] for i in range(batch)}
    seeds = torch.randint(0, 2**62, (batch,), device="cuda")
    return bf16_logits(batch, vocab, seed, scale=3.0), filter_params(vocab, rows), seeds


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels at the real size: needs a CUDA GPU")
@pytest.mark.parametrize("batch", [256, 1])
def test_real_vocabulary_in_a_cuda_graph_matches_the_reference(batch: int) -> None:
    """Qwen3's vocabulary in bf16 with the default tiles, buffers and chunk sizes, every row type in one batch,
    captured in a CUDA graph and replayed: the replay equals the eager call and the reference (kept sets exact
    up to the GPU's exp/log and FMA rounding: the token must be kept and the logprobs within 1e-3)."""
    vocab = 151936
    logits, params, seeds = real_vocabulary_batch(batch, vocab, seed=16)
    ws = ProcessedSamplingWorkspace("cuda", vocab)
    eager = processed_sample(logits, params, seeds, workspace=ws, num_top=5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = processed_sample(logits, params, seeds, workspace=ws, num_top=5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.tokens, eager.tokens) and torch.equal(captured.top_ids, eager.top_ids)
    check = list(range(min(batch, 24)))
    sub = ProcessedParams(params.floats[check].cpu(), params.ints[check].cpu())
    ref = reference_processed_sample(logits[check].cpu(), sub, seeds[check].cpu(), num_top=5)
    kept = (ref.y > -np.inf) & (ref.y >= eager.thresholds[check].cpu().numpy()[:, None])
    assert (kept[np.arange(len(check)), eager.tokens[check].cpu().numpy()]).all()
    assert (kept != ref.kept).sum() <= 2 * len(check)  # boundary ulps only
    np.testing.assert_allclose(eager.logprobs[check].cpu().numpy(), ref.logprobs, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels at the real size: needs a CUDA GPU")
def test_at_a_fixed_chunk_size_a_row_gets_the_same_bits_alone_and_in_a_batch_of_256() -> None:
    """Deterministic mode's sampler (workers/deterministic.py `sampling_chunk_size`): the chunk size of one row for
    every batch, so the float sums over a row's chunks group alike. 16 rows of every filter type computed alone and
    among 240 others: tokens, thresholds, logprobs and top logprobs bitwise equal. With the default chunk size (which
    follows the batch) the number of rows whose logprobs differ is printed, not asserted."""
    from workers import deterministic as det

    vocab, batch = 151936, 256
    names = list(FILTER_ROWS)
    logits, params, seeds = real_vocabulary_batch(batch, vocab, seed=34)
    ws = ProcessedSamplingWorkspace("cuda", vocab)
    saved = det.deterministic()
    det.set_deterministic(True)
    try:
        fixed = det.sampling_chunk_size(vocab, ws.tile_size, torch.device("cuda"))
    finally:
        det.set_deterministic(saved)
    assert fixed is not None
    for chunk in (fixed, None):
        together = processed_sample(logits, params, seeds, workspace=ws, num_top=5, chunk_size=chunk)
        differing = 0
        for r in range(16):
            alone = processed_sample(logits[r: r + 1], ProcessedParams(params.floats[r: r + 1], params.ints[r: r + 1]),
                                     seeds[r: r + 1], workspace=ws, num_top=5, chunk_size=chunk)
            same = all(torch.equal(getattr(alone, name)[0], getattr(together, name)[r])
                       for name in ("tokens", "thresholds", "logprobs", "top_logprobs", "top_ids"))
            if chunk is not None:
                assert same, f"row {r} ({names[r % len(names)]}) differs alone and in the batch"
            differing += not same
        print(f"chunk size {chunk or 'by the batch'}: {differing} of 16 rows differ alone and in a batch of {batch}")


# A fresh process compiles every kernel of a real-size call for sm90 (no GPU needed: Triton ships ptxas), since in
# this one they are interpreted, and the interpreter accepts code the compiler refuses (a name bound to tensors of
# two shapes in the branches of an `if`, say). The launches are recorded instead of run.
HOPPER_COMPILE = r"""
import numpy as np, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

launches = []
JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append((self, args, kwargs))
import gpu_kernels.processed_sampling as sampling_module, gpu_kernels.sampling_inputs as inputs_module
from gpu_kernels.processed_sampling import ProcessedSamplingWorkspace, processed_sample
sampling_module.pdl_for = inputs_module.pdl_for = lambda t: True  # compiled with PDL, as a GPU launches them
from gpu_kernels.sampling_inputs import I_STATE_ROW, PenaltyBits, ProcessedParams, SparseEntries

V, n = 151936, 2
TYPES = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32", torch.int64: "*i64"}
params = ProcessedParams.from_arrays(np.ones(n, np.float32), V, "cpu", top_k=np.ones(n), num_logprobs=np.full(n, 5))
bits = PenaltyBits("cpu", n, V)
for chunk in (2048, 4096, 8192):  # every chunk size the engine picks at this vocabulary
    processed_sample(torch.zeros(n, V, dtype=torch.bfloat16), params, torch.zeros(n, dtype=torch.int64),
                     workspace=ProcessedSamplingWorkspace("cpu", V, max_scratch_rows=n), penalties=bits,
                     bitmask=torch.zeros(n, V // 32 + 1, dtype=torch.int32),
                     sparse=SparseEntries.from_lists(n, "cpu", bias_rows=[0], bias_tokens=[3], bias_values=[1.0]),
                     last_sampled=torch.zeros(4, dtype=torch.int64), num_top=5, chunk_size=chunk)
bits.record(params.ints[:, I_STATE_ROW], torch.zeros(n, dtype=torch.int64))
compiled = set()
for fn, args, kwargs in launches:
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    assert kwargs.pop("launch_pdl") and kwargs["PDL"], fn.__name__
    sig = {name: TYPES[a.dtype] if isinstance(a, torch.Tensor) else "fp32" if isinstance(a, float) else "i32"
           for name, a in zip(fn.arg_names, args)} | {name: "constexpr" for name in kwargs}
    key = (fn.__name__, tuple(sorted(kwargs.items())))
    if key not in compiled:
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=kwargs), target=GPUTarget("cuda", 90, 32),
                                options=options)
        assert "griddepcontrol.wait" in kernel.asm["ptx"], fn.__name__
        compiled.add(key)
print(sorted({name for name, _ in compiled}))
"""


def test_every_kernel_compiles_for_hopper_at_the_real_size() -> None:
    pytest.importorskip("triton.backends.nvidia")
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", HOPPER_COMPILE], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == str(sorted(["_collect_kernel", "_finish_kernel", "_pivot_kernel", "_plan_kernel",
                                             "_prepare_kernel", "_rank_kernel", "_record_kernel", "_resolve_kernel",
                                             "_sample_kernel"]))
