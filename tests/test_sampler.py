"""The sampler: greedy rows are the exact argmax, other rows follow softmax(logits / T), seeded rows
are reproducible whatever shares their batch (BR-19)."""

from __future__ import annotations

import math

import pytest
import torch

from workers.sampler import Sampler, seeded_generator_seed

INF = float("inf")

# Logits of a 10-token vocabulary; the last token is masked, so 9 tokens can be drawn.
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.8, 0.3, -INF])
# The 0.999 quantile of the chi-square distribution with 9 - 1 = 8 degrees of freedom
# (scipy.stats.chi2.ppf(0.999, 8)): a correct sampler exceeds it with probability 0.1%.
CHI2_CRITICAL_DF8 = 26.124


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(torch.device("cpu"))


def temperatures(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def logits_with_clear_argmax(num_rows: int, vocab_size: int, seed: int, scale: float = 0.05) -> torch.Tensor:
    """Rows of distinct logits, adjacent values `scale` apart, so the argmax leads by at least `scale`."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab_size, generator=g).float() * scale for _ in range(num_rows)])


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of the draws `tokens` against `probs`, over the tokens with p > 0."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    drawable = probs > 0
    assert counts[~drawable].sum() == 0, "drew a token of probability 0"
    return float(((counts[drawable] - expected[drawable]) ** 2 / expected[drawable]).sum())


# ============================================================================ greedy (temperature 0)
def test_greedy_rows_are_the_argmax_of_the_logits(sampler: Sampler) -> None:
    logits = torch.randn(32, 1000, generator=torch.Generator().manual_seed(0)) * 4

    tokens = sampler(logits, torch.zeros(32), all_greedy=False)

    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_all_greedy_shortcut_equals_the_general_path(sampler: Sampler) -> None:
    logits = torch.randn(16, 500, generator=torch.Generator().manual_seed(1))

    shortcut = sampler(logits, torch.zeros(16), all_greedy=True)
    general = sampler(logits, torch.zeros(16), all_greedy=False)

    assert torch.equal(shortcut, general)
    assert torch.equal(shortcut, logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_greedy_on_half_precision_logits_is_their_argmax(sampler: Sampler, dtype: torch.dtype) -> None:
    logits = logits_with_clear_argmax(8, 300, seed=2, scale=0.125).to(dtype)

    tokens = sampler(logits, torch.zeros(8), all_greedy=False)

    assert torch.equal(tokens, logits.float().argmax(dim=-1))


def test_greedy_rows_stay_exact_in_a_batch_with_random_rows(sampler: Sampler) -> None:
    """BR-19 part 2: temperature-0 rows next to temperature-0.8 rows are still their argmax."""
    logits = torch.randn(12, 400, generator=torch.Generator().manual_seed(3))
    temps = temperatures(0, 0.8, 0, 1.5, 0, 0, 0.8, 2.0, 0, 0.8, 0, 1.0)
    greedy = temps == 0
    random_draws = []
    for step in range(20):
        torch.manual_seed(step)
        tokens = sampler(logits, temps, all_greedy=False)
        assert torch.equal(tokens[greedy], logits[greedy].argmax(dim=-1))
        random_draws.append(tokens[~greedy])

    # ...while the other rows really sample: over 20 steps they do not always pick the argmax.
    assert (torch.stack(random_draws) != logits[~greedy].argmax(dim=-1)).any()


def test_greedy_rows_ignore_masked_and_huge_logits(sampler: Sampler) -> None:
    logits = torch.tensor([[-INF, 3.0, -INF, 2.9], [-3e38, 3e38, 1.0, 2.0], [0.0, 65504.0, -65504.0, -INF]])

    tokens = sampler(logits, torch.zeros(3), all_greedy=False)

    assert tokens.tolist() == [1, 1, 1]


# ============================================================================ output
@pytest.mark.parametrize(("temps", "all_greedy"), [((0.0, 0.0, 0.0), True), ((0.0, 0.7, 1.0), False)])
def test_output_is_one_int64_token_per_row(sampler: Sampler, temps: tuple[float, ...], all_greedy: bool) -> None:
    logits = torch.randn(3, 151936, dtype=torch.bfloat16)

    tokens = sampler(logits, temperatures(*temps), all_greedy=all_greedy)

    assert tokens.dtype == torch.int64 and tokens.shape == (3,)
    assert ((tokens >= 0) & (tokens < 151936)).all()


# ============================================================================ temperature sampling
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_samples_follow_softmax_of_logits_over_temperature(sampler: Sampler, temperature: float) -> None:
    num_draws = 20000
    torch.manual_seed(1234)

    tokens = sampler(LOGITS.expand(num_draws, -1), torch.full((num_draws,), temperature), all_greedy=False)

    assert chi_square(tokens, torch.softmax(LOGITS / temperature, dim=-1)) < CHI2_CRITICAL_DF8
    # The test can tell temperatures apart: the same draws do not fit a 25% higher temperature.
    assert chi_square(tokens, torch.softmax(LOGITS / (1.25 * temperature), dim=-1)) > CHI2_CRITICAL_DF8


def test_seeded_samples_follow_softmax_of_logits_over_temperature(sampler: Sampler) -> None:
    num_draws, temperature = 4000, 0.8
    seeded_rows = [(row, 99, position) for row, position in enumerate(range(num_draws))]

    tokens = sampler(LOGITS.expand(num_draws, -1), torch.full((num_draws,), temperature), False, seeded_rows)

    assert chi_square(tokens, torch.softmax(LOGITS / temperature, dim=-1)) < CHI2_CRITICAL_DF8


def test_tiny_temperature_behaves_like_greedy(sampler: Sampler) -> None:
    """BR-19 part 3: temperature 1e-6 picks the argmax, also with masked and large logits."""
    logits = logits_with_clear_argmax(64, 1000, seed=4, scale=0.01)
    logits[1::3] *= 3e3  # magnitudes up to 3e4
    logits[2::3] -= 1e4  # a large common offset
    masked = torch.rand(logits.shape, generator=torch.Generator().manual_seed(4)) < 0.3
    masked.scatter_(1, logits.argmax(dim=-1, keepdim=True), False)
    logits[masked] = -INF
    torch.manual_seed(5)

    tokens = sampler(logits, torch.full((64,), 1e-6), all_greedy=False)

    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_tiny_temperature_on_extreme_logits_still_picks_the_argmax(sampler: Sampler) -> None:
    logits = torch.tensor([[1.0, 1e33, 2.0, -1e33], [-INF, 2e38, 1e38, -INF]])

    tokens = sampler(logits, temperatures(1e-6, 0.5), all_greedy=False)

    assert tokens.tolist() == [1, 1]


def test_temperature_two_never_draws_a_masked_token(sampler: Sampler) -> None:
    """BR-19 part 3: temperature 2.0 with -inf and huge finite logits gives valid tokens only."""
    rows = torch.tensor([[0.0, 1.0, 2.0, -INF], [3e38, -3e38, 1.0, -INF], [-INF, -INF, -INF, 5.0],
                         [6e4, 6e4 - 1.0, -6e4, -INF]])
    logits = rows.repeat(500, 1)
    torch.manual_seed(6)

    tokens = sampler(logits, torch.full((2000,), 2.0), all_greedy=False).view(500, 4)

    assert (tokens[:, 0] != 3).all() and (tokens[:, 3] != 3).all()
    assert (tokens[:, 1] == 0).all()  # 3e38 / 2 still dominates every other logit
    assert (tokens[:, 2] == 3).all()  # the only unmasked token
    assert set(tokens[:, 0].tolist()) == {0, 1, 2}
    assert set(tokens[:, 3].tolist()) <= {0, 1} and (tokens[:, 3] == 1).any()


# ============================================================================ seeds
def seeded_token(sampler: Sampler, logits: torch.Tensor, temps: torch.Tensor, row: int, seed: int,
                 position: int, others: list[tuple[int, int, int]] | None = None) -> int:
    tokens = sampler(logits, temps, False, [*(others or []), (row, seed, position)])
    return int(tokens[row])


def test_seeded_row_gives_the_same_token_alone_and_in_any_batch(sampler: Sampler) -> None:
    g = torch.Generator().manual_seed(7)
    row_logits = torch.randn(1, 2000, generator=g)
    batch = torch.randn(9, 2000, generator=g)
    for seed, position in [(0, 0), (1234, 57), (-5, 3000), (2**62, 1)]:
        alone = seeded_token(sampler, row_logits, temperatures(0.9), 0, seed, position)
        for row in (0, 4, 8):
            logits = batch.clone()
            logits[row] = row_logits[0]
            temps = temperatures(0, 0.9, 1.3, 0.9, 0.9, 0, 2.0, 0.9, 0.9)
            temps[row] = 0.9
            others = [(r, 77 + r, position + r) for r in (1, 2) if r != row]
            torch.manual_seed(row)  # unseeded rows draw from a different global state each time

            assert seeded_token(sampler, logits, temps, row, seed, position, others) == alone


def test_seeded_rows_draw_new_noise_at_each_position(sampler: Sampler) -> None:
    uniform = torch.zeros(200, 64)
    seeded_rows = [(position, 3, position) for position in range(200)]

    tokens = sampler(uniform, torch.ones(200), False, seeded_rows)

    # 200 uniform draws over 64 tokens hit about 61 distinct ones; the same noise would give 1.
    assert len(set(tokens.tolist())) >= 45


def test_different_seeds_draw_different_noise_at_the_same_position(sampler: Sampler) -> None:
    uniform = torch.zeros(200, 64)
    seeded_rows = [(row, 1000 + row, 17) for row in range(200)]

    tokens = sampler(uniform, torch.ones(200), False, seeded_rows)

    assert len(set(tokens.tolist())) >= 45


def test_generator_seeds_are_distinct_non_negative_63_bit_integers() -> None:
    user_seeds = (-1, 0, 1, 2, 1234, 2**40 + 3)
    seeds = {seeded_generator_seed(seed, position) for seed in user_seeds for position in range(256)}

    assert len(seeds) == 6 * 256
    assert all(0 <= s < 2**63 for s in seeds)


def test_seeded_row_at_tiny_temperature_is_greedy(sampler: Sampler) -> None:
    logits = logits_with_clear_argmax(4, 500, seed=8)

    tokens = sampler(logits, torch.full((4,), 1e-6), False, [(r, 42, 10 * r) for r in range(4)])

    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_greedy_row_with_a_seed_is_still_the_argmax(sampler: Sampler) -> None:
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(9))

    tokens = sampler(logits, temperatures(0, 1.0, 0), False, [(0, 5, 1), (2, 6, 1)])

    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_chi_square_critical_value_is_the_0_999_quantile() -> None:
    """Check of the hard-coded constant: P(chi2_8 > 26.124) = 0.001 (regularized gamma series)."""
    k, x = 8 / 2, CHI2_CRITICAL_DF8 / 2
    term = total = 1 / k
    n = 0
    while term > 1e-16 * total:
        n += 1
        term *= x / (k + n)
        total += term
    lower = total * math.exp(-x + k * math.log(x) - math.lgamma(k))

    assert 1 - lower == pytest.approx(0.001, rel=1e-3)


# ============================================================================ vocabulary split over ranks
@pytest.mark.parametrize("splits", [(0, 500, 1000), (0, 123, 640, 1000)])
def test_rank_slices_pick_the_token_of_the_whole_vocabulary(splits: tuple[int, ...]) -> None:
    """Tensor parallelism on CPU: rank samplers with the same engine seed see only their slice, and
    the best of their candidates is the token one sampler over the whole vocabulary picks, for
    greedy, random and seeded rows alike."""
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(10)) * 3
    temps = temperatures(*[0.0, 0.7, 1.0, 2.0] * 4)
    seeded = [(1, 5, 9), (6, 77, 0), (11, -3, 2**40)]
    whole = Sampler(torch.device("cpu"), seed=3)(logits, temps, False, seeded)
    candidates = [Sampler(torch.device("cpu"), seed=3, vocab_size=1000, vocab_start=a)._cpu_candidates(
        logits[:, a:b], temps, _row_seeds(3, 16, seeded)) for a, b in zip(splits, splits[1:])]
    scores = torch.stack([c[0] for c in candidates])
    tokens = torch.stack([c[1] for c in candidates])
    assert torch.equal(tokens.gather(0, scores.argmax(dim=0, keepdim=True)).squeeze(0), whole)


def _row_seeds(engine_seed: int, n: int, seeded: list[tuple[int, int, int]]):
    """The per-row seeds a Sampler(seed=engine_seed) draws for its first call."""
    import numpy as np

    seeds = np.random.default_rng(engine_seed).integers(0, 2**62, size=n, dtype=np.int64)
    for row, seed, position in seeded:
        seeds[row] = seeded_generator_seed(seed, position)
    return seeds

