"""Lists a request may carry are bounded, and the bad words of a request are tokenized in one batched call:
50,000 bad words once held the frontend's loop for more than 20 s (a quadratic de-duplication), long enough for
the scheduler to take the frontend for dead and stop the engine."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from common.sampling_params import (
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SamplingParams,
)
from frontend.validation import bad_words_token_ids, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(qwen3_tokenizer_dir: Path) -> object:
    return load_tokenizer(str(qwen3_tokenizer_dir))


def one_word_at_a_time(tokenizer: object, words: list[str]) -> list[list[int]]:
    """The rule word by word, as the frontend applied it before."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        for ids in (bare, spaced) if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare) else (
                bare,):
            if ids and ids not in out:
                out.append(ids)
    return out


def test_batched_bad_words_give_the_word_by_word_ids(tokenizer: object) -> None:
    words = ["hello", " hello", "Paris", "ďábelské", "价格", "New York", "hello", "  x", "👍🏽", "the end"]

    assert bad_words_token_ids(tokenizer, words) == one_word_at_a_time(tokenizer, words)
    assert bad_words_token_ids(tokenizer, []) == []


def test_the_most_bad_words_allowed_are_tokenized_in_well_under_a_second(tokenizer: object) -> None:
    words = [f"w{i}" for i in range(MAX_BAD_WORDS)]
    t0 = time.perf_counter()
    ids = bad_words_token_ids(tokenizer, words)

    assert len(ids) >= MAX_BAD_WORDS
    assert time.perf_counter() - t0 < 5.0  # a guard against the quadratic path (it took seconds), not a benchmark


@pytest.mark.parametrize(("field", "value", "message"), [
    ("bad_words", [f"w{i}" for i in range(MAX_BAD_WORDS + 1)], f"bad_words may hold at most {MAX_BAD_WORDS} words"),
    ("stop", [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], f"stop may hold at most {MAX_STOP_STRINGS} strings"),
])
def test_a_list_over_its_limit_is_refused_naming_the_field(field: str, value: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})
    SamplingParams(**{field: value[:-1]})  # at the limit: accepted


@pytest.mark.parametrize(("field", "limit", "message"), [
    ("bad_words", MAX_BAD_WORD_CHARS, f"each word may have at most {MAX_BAD_WORD_CHARS} characters"),
    ("stop", MAX_STOP_STRING_CHARS, f"each string may have at most {MAX_STOP_STRING_CHARS} characters")])
def test_a_string_over_its_length_is_refused_naming_the_field(field: str, limit: int, message: str) -> None:
    """Long words held the frontend's one loop while they were tokenized (a fresh user's trial: 1,024 bad words of
    40,000 characters ended the engine through the scheduler's liveness limit)."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: ["ok", "x" * (limit + 1)]})
    SamplingParams(**{field: ["ok", "x" * limit]})  # at the limit: accepted
