"""Logits processing (workers/logits_processing.py) against a numpy reference on fixed logits: each step
alone and in combination (exact masks, probabilities to 1e-6), logprobs, and the sampler drawing from the
filtered distribution in proportion (chi-square on a tiny model's logits)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from common.protocol import SamplingOptions
from workers.logits_processing import TOPK_CANDIDATES, LogitsProcessor, build_processing
from workers.request_state import ReqState
from workers.sampler import ProcessedRows, Sampler

CPU = torch.device("cpu")
V = 2000
INF = float("inf")


# ============================================================================ numpy reference
def ref_filters(x: np.ndarray, k: int = 0, p: float = 1.0, m: float = 0.0) -> np.ndarray:
    """top-k (ties with the k-th kept), then top-p (a token stays when the mass of the kept tokens strictly
    more likely than it is below p), then min-p (prob >= m * max prob), over one row, in float64."""
    x = x.astype(np.float64)
    keep = np.ones(len(x), bool)
    if k > 0:
        keep &= x >= np.sort(x)[::-1][k - 1]
    if p < 1.0:
        kept = np.where(keep, x, -np.inf)
        q = np.exp(kept - kept.max())
        q /= q.sum()
        order = np.argsort(-kept, kind="stable")
        descending = kept[order]
        exclusive = np.cumsum(q[order]) - q[order]
        first_of_value = np.searchsorted(-descending, -descending, side="left")
        above = np.empty_like(q)
        above[order] = exclusive[first_of_value]  # the mass of the tokens strictly more likely
        keep &= above < p
    if m > 0.0:
        keep &= x >= x.max() + np.log(m)
    return np.where(keep, x, -np.inf)


def ref_penalties(x: np.ndarray, prompt: list[int], output: list[int], rep: float = 1.0, freq: float = 0.0,
                  pres: float = 0.0) -> np.ndarray:
    x = x.astype(np.float64).copy()
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=len(x)).astype(np.float64)
    seen = counts > 0
    seen[np.asarray(prompt, dtype=np.int64)] = True
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    return x - freq * counts - pres * (counts > 0)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def log_softmax(x: np.ndarray) -> np.ndarray:
    finite = x[np.isfinite(x)]
    return x - (finite.max() + np.log(np.exp(finite - finite.max()).sum()))


# ============================================================================ helpers
def state(row: int, options: SamplingOptions | None, prompt: list[int] = (7, 8, 9), output: list[int] = (),
          temperature: float = 1.0, in_flight: bool = False) -> ReqState:
    """A worker request state in batch row `row` with these tokens; `in_flight`: its last output token has
    not reached the host yet."""
    st = ReqState(row, temperature, None, options)
    st.row = row
    tokens = np.zeros(64, np.int32)
    tokens[: len(prompt)] = prompt
    tokens[len(prompt): len(prompt) + len(output)] = output
    st.tokens = tokens
    st.num_prompt_tokens = len(prompt)
    st.num_tokens = len(prompt) + len(output)
    st.num_tokens_cpu = st.num_tokens - (1 if in_flight else 0)
    return st


def process(states: list[ReqState], logits: torch.Tensor, last_sampled: torch.Tensor | None = None):
    """Run the pipeline over the processed rows of `states` (logits `[S, V]`): (processed `[R, V]`, the
    device inputs, the processor)."""
    temps = np.array([st.temperature for st in states], np.float32)
    inputs = build_processing(states, temps, logits.shape[1])
    assert inputs is not None
    proc = LogitsProcessor(CPU, max_num_seqs=max(16, len(states)), vocab_size=logits.shape[1])
    proc.penalties.reset_rows([st for st in states if st.penalized])
    d = proc.upload(inputs)
    x = logits[d.i["rows"]].float().clone()
    last = last_sampled if last_sampled is not None else torch.zeros(16, dtype=torch.int64)
    return proc.apply(x, d, last), d, proc


def distinct_logits(rows: int, seed: int, scale: float = 3.0, vocab: int = V) -> torch.Tensor:
    """Rows of distinct float32 logits (no ties), roughly normal."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * scale
    base += torch.arange(vocab, dtype=torch.float64) * 1e-6  # break any tie
    return base.float()


def assert_matches(processed: torch.Tensor, reference: np.ndarray) -> None:
    """Same mask exactly, same distribution to 1e-6."""
    got = processed.double().numpy()
    assert np.array_equal(np.isfinite(got), np.isfinite(reference)), (
        f"kept {np.isfinite(got).sum()} tokens, the reference keeps {np.isfinite(reference).sum()}")
    np.testing.assert_allclose(softmax(got), softmax(reference), atol=1e-6, rtol=0)


# ============================================================================ filters
@pytest.mark.parametrize("k", [1, 2, 17, 50, 999, TOPK_CANDIDATES + 1])
def test_top_k_keeps_exactly_the_k_largest_logits(k: int) -> None:
    logits = distinct_logits(3, seed=k)
    x, _, _ = process([state(i, SamplingOptions(top_k=k)) for i in range(3)], logits)
    for row in range(3):
        assert np.isfinite(x[row].numpy()).sum() == k
        assert_matches(x[row], ref_filters(logits[row].numpy(), k=k))


@pytest.mark.parametrize("p", [0.05, 0.3, 0.9, 0.999])
def test_top_p_keeps_the_smallest_set_of_most_likely_tokens_reaching_p(p: float) -> None:
    logits = distinct_logits(4, seed=int(p * 1000))
    x, _, _ = process([state(i, SamplingOptions(top_p=p)) for i in range(4)], logits)
    for row in range(4):
        ref = ref_filters(logits[row].numpy(), p=p)
        assert_matches(x[row], ref)
        kept = softmax(logits[row].double().numpy())[np.isfinite(ref)]  # their mass in the unfiltered distribution
        assert kept.sum() >= p - 1e-6 and kept.sum() - kept.min() < p  # reaches p, and no token is spare


@pytest.mark.parametrize("m", [0.01, 0.1, 0.5, 1.0])
def test_min_p_drops_tokens_less_likely_than_min_p_times_the_top(m: float) -> None:
    logits = distinct_logits(3, seed=int(m * 100), scale=2.0)
    x, _, _ = process([state(i, SamplingOptions(min_p=m)) for i in range(3)], logits)
    for row in range(3):
        assert_matches(x[row], ref_filters(logits[row].numpy(), m=m))
    if m == 1.0:
        assert (np.isfinite(x.numpy()).sum(axis=1) == 1).all()  # only the most likely token


@pytest.mark.parametrize(("k", "p", "m"), [(50, 0.9, 0.0), (50, 0.9, 0.05), (10, 0.5, 0.3), (0, 0.7, 0.02),
                                           (TOPK_CANDIDATES + 5, 0.8, 0.01), (3, 0.999, 0.0)])
def test_top_k_then_top_p_then_min_p_combine_in_that_order(k: int, p: float, m: float) -> None:
    logits = distinct_logits(4, seed=k + int(100 * p))
    x, _, _ = process([state(i, SamplingOptions(top_k=k, top_p=p, min_p=m)) for i in range(4)], logits)
    for row in range(4):
        assert_matches(x[row], ref_filters(logits[row].numpy(), k=k, p=p, m=m))


def test_rows_with_different_filters_share_one_step_and_match_their_own_reference() -> None:
    logits = distinct_logits(6, seed=11)
    specs = [dict(top_k=5), dict(top_p=0.6), dict(min_p=0.2), dict(top_k=40, top_p=0.8),
             dict(top_k=TOPK_CANDIDATES + 20), dict(top_k=7, top_p=0.95, min_p=0.01)]
    x, _, _ = process([state(i, SamplingOptions(**spec)) for i, spec in enumerate(specs)], logits)
    for row, spec in enumerate(specs):
        ref = ref_filters(logits[row].numpy(), k=spec.get("top_k", 0), p=spec.get("top_p", 1.0),
                          m=spec.get("min_p", 0.0))
        assert_matches(x[row], ref)


def test_ties_at_the_k_th_logit_are_all_kept_also_beyond_the_candidates() -> None:
    """bf16 logits tie often: every token equal to the k-th largest stays (vLLM's rule), and top-p counts
    the mass of the ties that torch.topk left out of its k candidates."""
    row = np.full(V, -5.0, np.float32)
    row[:3] = [4.0, 3.0, 2.0]
    row[3:13] = 1.0  # ten tokens tied at the 4th largest logit
    logits = torch.from_numpy(np.stack([row, row]))
    x, _, _ = process([state(0, SamplingOptions(top_k=4)), state(1, SamplingOptions(top_k=4, top_p=0.99))], logits)
    assert np.isfinite(x[0].numpy()).sum() == 13
    assert_matches(x[0], ref_filters(row, k=4))
    assert_matches(x[1], ref_filters(row, k=4, p=0.99))


def test_top_p_keeps_or_drops_tied_tokens_together() -> None:
    row = np.full(V, -30.0, np.float32)
    row[:4] = [2.0, 1.0, 1.0, 1.0]
    logits = torch.from_numpy(np.stack([row, row]))
    for k in (0, 3):  # a whole-row sort, and topk candidates that hold only two of the three tied tokens
        x, _, _ = process([state(0, SamplingOptions(top_p=0.5, top_k=k)), state(1, SamplingOptions(top_p=0.4,
                                                                                                  top_k=k))], logits)
        # p(first) = e / (e + 3) = 0.475: below 0.5, the three tied tokens have 0.475 above them and all stay;
        # not below 0.4, they all go.
        assert np.isfinite(x.numpy()).sum(axis=1).tolist() == [4, 1]
        assert_matches(x[0], ref_filters(row, k=k, p=0.5))
        assert_matches(x[1], ref_filters(row, k=k, p=0.4))


def test_the_most_likely_token_always_survives_the_filters() -> None:
    logits = distinct_logits(3, seed=5, scale=30.0)  # peaked: the top token has nearly all the mass
    x, _, _ = process([state(i, SamplingOptions(top_p=1e-9, top_k=1, min_p=1.0)) for i in range(3)], logits)
    kept = np.isfinite(x.numpy())
    assert (kept.sum(axis=1) == 1).all()
    assert (kept.argmax(axis=1) == logits.argmax(dim=1).numpy()).all()


def test_filters_run_after_temperature() -> None:
    """top-p depends on the temperature (it reshapes the distribution); top-k and min-p's ratio too."""
    logits = distinct_logits(2, seed=6)
    sts = [state(0, SamplingOptions(top_p=0.8), temperature=0.5), state(1, SamplingOptions(top_p=0.8, min_p=0.1),
                                                                        temperature=2.0)]
    x, _, _ = process(sts, logits)
    assert_matches(x[0], ref_filters(logits[0].numpy() / 0.5, p=0.8))
    assert_matches(x[1], ref_filters(logits[1].numpy() / 2.0, p=0.8, m=0.1))


def test_greedy_rows_are_divided_by_one_and_sample_at_temperature_zero() -> None:
    logits = distinct_logits(1, seed=7)
    _, d, _ = process([state(0, SamplingOptions(logprobs=2), temperature=0.0)], logits)
    assert d.host.temperatures.tolist() == [1.0] and d.host.sample_temperatures.tolist() == [0.0]


# ============================================================================ bias, bans, penalties
def test_logit_bias_is_added_before_the_filters() -> None:
    logits = distinct_logits(1, seed=8)
    weakest = int(logits[0].argmin())
    x, _, _ = process([state(0, SamplingOptions(logit_bias={weakest: 100.0, 3: -100.0}, top_k=1))], logits)
    assert np.flatnonzero(np.isfinite(x[0].numpy())).tolist() == [weakest]
    x, _, _ = process([state(0, SamplingOptions(logit_bias={3: -2.5, 9: 1.5}))], logits)
    ref = logits[0].double().numpy().copy()
    ref[3] -= 2.5
    ref[9] += 1.5
    np.testing.assert_allclose(x[0].double().numpy(), ref, atol=1e-5)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    logits = distinct_logits(1, seed=9)
    prompt, output = [1, 2, 3, 50], [3, 60, 60]
    x, _, _ = process([state(0, SamplingOptions(repetition_penalty=1.7), prompt=prompt, output=output)], logits)
    np.testing.assert_allclose(x[0].double().numpy(), ref_penalties(logits[0].numpy(), prompt, output, rep=1.7),
                               rtol=1e-6)


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    logits = distinct_logits(1, seed=10)
    prompt, output = [4, 5, 6], [6, 7, 7, 7, 8]
    opts = SamplingOptions(frequency_penalty=0.5, presence_penalty=-1.25)
    x, _, _ = process([state(0, opts, prompt=prompt, output=output)], logits)
    ref = ref_penalties(logits[0].numpy(), prompt, output, freq=0.5, pres=-1.25)
    np.testing.assert_allclose(x[0].double().numpy(), ref, rtol=1e-6, atol=1e-6)
    assert x[0, 4] == logits[0, 4]  # a prompt token is not penalized by them


def test_all_penalties_combined_with_filters_match_the_reference() -> None:
    logits = distinct_logits(3, seed=12)
    prompt, outputs = [10, 11, 12], [[13, 13], [10, 14], []]
    opts = SamplingOptions(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, top_k=30, top_p=0.85)
    sts = [state(i, opts, prompt=prompt, output=out, temperature=0.7) for i, out in enumerate(outputs)]
    plain = state(3, SamplingOptions(top_k=30, top_p=0.85), prompt=prompt, output=[13], temperature=0.7)
    x, _, _ = process([*sts, plain], torch.cat([logits, logits[:1]]))
    for row, out in enumerate(outputs):
        ref = ref_penalties(logits[row].numpy(), prompt, out, 1.3, 0.4, 0.2) / 0.7
        assert_matches(x[row], ref_filters(ref, k=30, p=0.85))
    assert_matches(x[3], ref_filters(logits[0].double().numpy() / 0.7, k=30, p=0.85))  # no penalty: untouched


def test_penalty_counts_follow_the_tokens_sampled_on_the_device() -> None:
    logits = distinct_logits(1, seed=13)
    st = state(2, SamplingOptions(frequency_penalty=1.0), prompt=[1])
    x, d, proc = process([st], logits)
    proc.record_sampled(d, torch.tensor([42]))
    proc.record_sampled(d, torch.tensor([42]))
    penalties = proc.penalties
    assert penalties.output_counts[2, 42] == 2 and penalties.output_counts[2].sum() == 2
    assert penalties.seen[2].nonzero().flatten().tolist() == [1, 42]  # the prompt token and the sampled one
    penalties.reset_rows([state(2, SamplingOptions(frequency_penalty=1.0), prompt=[1], output=[5])])
    assert penalties.output_counts[2, 42] == 0 and penalties.output_counts[2, 5] == 1
    assert penalties.seen[2].nonzero().flatten().tolist() == [1, 5]


def test_min_tokens_masks_stop_tokens_until_enough_were_generated() -> None:
    logits = distinct_logits(2, seed=14)
    opts = SamplingOptions(min_tokens=3, stop_token_ids=[1, 2])
    x, _, _ = process([state(0, opts, output=[5, 6]), state(1, opts, output=[5, 6, 7])], logits)
    assert not torch.isfinite(x[0, [1, 2]]).any() and torch.isfinite(x[0]).sum() == V - 2
    assert torch.equal(x[1], logits[1])  # three tokens generated: stop tokens are allowed again


def test_bad_words_ban_their_last_token_after_the_rest_of_the_word() -> None:
    logits = distinct_logits(4, seed=15)
    opts = SamplingOptions(bad_words=[[30], [40, 41], [50, 51, 52]])
    sts = [state(0, opts, output=[1, 40]), state(1, opts, output=[50, 51]), state(2, opts, output=[51]),
           state(3, opts, output=[50, 51], in_flight=True)]
    last = torch.zeros(16, dtype=torch.int64)
    last[3] = 9  # row 3's last token (51 on the host's books) is still on its way: the device has 9
    x, _, _ = process(sts, logits, last)
    banned = [np.flatnonzero(~np.isfinite(x[r].numpy())).tolist() for r in range(4)]
    assert banned == [[30, 41], [30, 52], [30], [30]]
    last[3] = 51
    x, _, _ = process(sts, logits, last)
    assert np.flatnonzero(~np.isfinite(x[3].numpy())).tolist() == [30, 52]


# ============================================================================ logprobs
def test_logprobs_are_the_log_softmax_of_the_processed_logits() -> None:
    logits = distinct_logits(3, seed=16)
    sts = [state(0, SamplingOptions(logprobs=5, top_k=20), temperature=0.8),
           state(1, SamplingOptions(logprobs=0, repetition_penalty=1.2), prompt=[1, 2]),
           state(2, SamplingOptions(logprobs=3, top_p=0.3), temperature=0.0)]
    x, d, proc = process(sts, logits)
    tokens = torch.tensor([int(x[0].argmax()), 7, int(x[2].argmax())])
    lp, rank, top_lp, top_ids = proc.logprobs(x, d, tokens)
    for row in range(3):
        ref = log_softmax(x[row].double().numpy())
        assert lp[row].item() == pytest.approx(ref[tokens[row]], abs=1e-5)
        assert rank[row].item() == 1 + int((ref > ref[tokens[row]]).sum())
        order = np.argsort(-ref, kind="stable")[:5]
        np.testing.assert_allclose(top_lp[row].numpy(), ref[order], atol=1e-5)
    assert rank[1].item() > 1  # token 7 is not the most likely
    assert np.isfinite(top_lp[0].numpy()).all()  # 20 tokens kept: the top 5 are finite


# ============================================================================ sampling from the result
CHI2_P = 0.001


def chi2_survival(x: float, df: int) -> float:
    """P(chi2_df > x), from the regularized lower incomplete gamma series."""
    k, h = df / 2, x / 2
    term = total = 1 / k
    n = 0
    while term > 1e-17 * total:
        n += 1
        term *= h / (k + n)
        total += term
    return 1 - total * math.exp(-h + k * math.log(h) - math.lgamma(k))


def test_chi2_survival_matches_known_quantiles() -> None:
    assert chi2_survival(26.124, 8) == pytest.approx(0.001, rel=1e-3)
    assert chi2_survival(3.841, 1) == pytest.approx(0.05, rel=1e-3)


@pytest.fixture(scope="module")
def model_logits(tiny_qwen3: Path) -> torch.Tensor:
    """The tiny checkpoint's next-token logits after a short prompt (transformers, float32), first 3000 ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    ids = torch.tensor([tok("The quick brown fox")["input_ids"]])
    with torch.no_grad():
        return model(ids).logits[0, -1, :3000].clone()


@pytest.mark.parametrize("spec", [dict(top_k=20), dict(top_p=0.5), dict(min_p=0.05),
                                  dict(top_k=50, top_p=0.8, min_p=0.02)], ids=str)
def test_filtered_samples_never_leave_the_kept_set_and_follow_its_distribution(model_logits: torch.Tensor,
                                                                               spec: dict) -> None:
    draws = 6000
    ref = ref_filters(model_logits.numpy(), k=spec.get("top_k", 0), p=spec.get("top_p", 1.0),
                      m=spec.get("min_p", 0.0))
    kept = np.flatnonzero(np.isfinite(ref))
    assert 5 <= len(kept) <= 60, len(kept)  # the test has cells to compare, each with an expected count >= 5
    rows = 1000
    sts = [state(i, SamplingOptions(**spec)) for i in range(rows)]
    tokens = []
    sampler = Sampler(CPU, seed=3)
    logits = model_logits.expand(rows, -1).contiguous()
    for _ in range(draws // rows):
        x, d, _ = process(sts, logits)
        processed = ProcessedRows(d.i["rows"], d.host.rows, x, d.f["sample_temperatures"], True)
        tokens.append(sampler(logits, torch.ones(rows), False, None, processed))
    counts = np.bincount(torch.cat(tokens).numpy(), minlength=len(ref))
    assert counts[~np.isfinite(ref)].sum() == 0, "drew a token the filters removed"
    expected = softmax(ref)[kept] * counts.sum()
    assert expected.min() >= 5
    statistic = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2_survival(statistic, len(kept) - 1) > CHI2_P, statistic
