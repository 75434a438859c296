"""The fused sampling kernel (kernels/sampling.py) against softmax(logits / T) and argmax."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from kernels.sampling import sample_tokens  # noqa: E402

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


@pytest.mark.parametrize("temperature", [0.6, 1.7])
def test_samples_follow_softmax_of_scaled_logits(temperature: float) -> None:
    torch.manual_seed(3)
    vocab, n = VOCAB, DRAWS
    row = torch.randn(vocab) * 2
    logits = row.repeat(n, 1).to(DEVICE)
    seeds = (torch.arange(n, dtype=torch.int64) * 7919 + 11).to(DEVICE)
    out = sample_tokens(logits, torch.full((n,), temperature, device=DEVICE), seeds).cpu()
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


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError):
        sample_tokens(torch.zeros(3, device=DEVICE), torch.zeros(3, device=DEVICE),
                      torch.zeros(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError):
        sample_tokens(torch.zeros(2, 5, device=DEVICE), torch.zeros(3, device=DEVICE),
                      torch.zeros(2, dtype=torch.int64, device=DEVICE))
