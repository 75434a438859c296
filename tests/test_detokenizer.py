"""Streaming detokenization with the real Qwen3 tokenizer (BR-22 parts 1-3): the deltas add up to
`decode(ids)` exactly, never hold a broken or repeated character, and never repeat prompt text."""

from __future__ import annotations

from itertools import cycle
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from frontend.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"  # what decode() shows for bytes that are not (yet) a whole character
MIXED = "价格 是 100元 👍🏽 ďábelské 삼겹살"


@pytest.fixture(scope="module")
def tokenizer(qwen3_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which names the 256 single-byte tokens of byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


BYTE_TOKENS = _byte_level_alphabet()


def byte_ids(tokenizer: Any, text: str) -> list[int]:
    """One token per UTF-8 byte of `text`: the finest split a byte-level model can produce."""
    ids = tokenizer.convert_tokens_to_ids([BYTE_TOKENS[b] for b in text.encode()])
    assert tokenizer.unk_token_id not in ids
    return ids


def stream(tokenizer: Any, prompt_ids: list[int], output_ids: list[int], group_sizes: list[int] | None = None,
           skip_special_tokens: bool = True) -> tuple[list[str], str]:
    """Feed `output_ids` in groups (one id each by default); the text delta of each group, and flush()."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    sizes = cycle(group_sizes or [1])
    deltas, i = [], 0
    while i < len(output_ids):
        n = next(sizes)
        deltas.append("".join(detok.step(token_id) for token_id in output_ids[i:i + n]))
        i += n
    return deltas, detok.flush()


def assert_clean_stream(deltas: list[str], expected: str) -> None:
    """The deltas add up to `expected`; each is the next piece of it (no repeat, no U+FFFD it lacks)."""
    sent = ""
    for delta in deltas:
        assert expected.startswith(sent + delta), f"after {sent!r}, delta {delta!r} is not the next text"
        assert REPLACEMENT not in delta or REPLACEMENT in expected[len(sent):len(sent) + len(delta)]
        sent += delta
    assert sent == expected


def whole_prompt_text(tokenizer: Any, prompt_ids: list[int]) -> str:
    """The prompt's text up to its last whole character (decode() shows later bytes as U+FFFD)."""
    return tokenizer.decode(prompt_ids).rstrip(REPLACEMENT)


# ============================================================================ BR-22 parts 1 and 2
def test_mixed_text_splits_characters_over_tokens(tokenizer: Any) -> None:
    """The premise of parts 1-2: some tokens of MIXED hold only part of a character."""
    ids = encode(tokenizer, MIXED)

    assert tokenizer.decode(ids) == MIXED
    assert sum(REPLACEMENT in tokenizer.decode([i]) for i in ids) >= 4


def test_ids_one_at_a_time_stream_exactly_the_decoded_text(tokenizer: Any) -> None:
    ids = encode(tokenizer, MIXED)

    deltas, tail = stream(tokenizer, [], ids)

    assert_clean_stream(deltas, tokenizer.decode(ids))
    assert tail == ""
    assert REPLACEMENT not in "".join(deltas)
    # The emoji and its modifier each come out whole, in one delta each.
    assert any("👍" in d for d in deltas) and "🏽" in deltas


@pytest.mark.parametrize("offset", range(4))
def test_ids_in_uneven_groups_stream_exactly_the_decoded_text(tokenizer: Any, offset: int) -> None:
    sizes = [1, 3, 2, 1]
    ids = encode(tokenizer, MIXED)

    deltas, tail = stream(tokenizer, [], ids, group_sizes=sizes[offset:] + sizes[:offset])

    assert_clean_stream(deltas, MIXED)
    assert tail == ""


def test_byte_by_byte_ids_stream_each_character_once_and_whole(tokenizer: Any) -> None:
    ids = byte_ids(tokenizer, MIXED)

    deltas, tail = stream(tokenizer, [], ids)

    assert_clean_stream(deltas, MIXED)
    assert [d for d in deltas if d] == list(MIXED)
    assert tail == ""


def test_generated_text_after_a_chat_prompt_streams_exactly(tokenizer: Any) -> None:
    prompt = encode(tokenizer, "<|im_start|>user\n价格是多少？<|im_end|>\n<|im_start|>assistant\n")
    output = encode(tokenizer, MIXED)

    deltas, tail = stream(tokenizer, prompt, output, group_sizes=[2, 1, 3])

    assert_clean_stream(deltas, MIXED)
    assert tail == ""


# ============================================================================ BR-22 part 3
def prompt_ending_inside_a_character(tokenizer: Any, before: str, char: str, prompt_bytes: int,
                                     after: str) -> tuple[list[int], list[int]]:
    """Prompt = `before` + the first `prompt_bytes` byte tokens of `char`; output = the rest + `after`."""
    split = byte_ids(tokenizer, char)
    return encode(tokenizer, before) + split[:prompt_bytes], split[prompt_bytes:] + encode(tokenizer, after)


@pytest.mark.parametrize(
    ("before", "char", "prompt_bytes", "after"),
    [
        ("The price: ", "价", 1, "格 100元"),  # first of 3 bytes
        ("The price: ", "价", 2, "格 100元"),
        ("so hot ", "🫠", 1, " today"),  # first of 4 bytes
        ("so hot ", "🫠", 3, " today"),
        ("", "삼", 1, "겹살"),  # the prompt is nothing but the partial character
        ("A longer prompt, " * 20, "ď", 1, "ábelské"),
    ],
    ids=["cjk-1of3", "cjk-2of3", "emoji-1of4", "emoji-3of4", "only-partial-prompt", "long-prompt-latin"],
)
def test_prompt_ending_inside_a_character_streams_only_generated_text(
    tokenizer: Any, before: str, char: str, prompt_bytes: int, after: str
) -> None:
    prompt, output = prompt_ending_inside_a_character(tokenizer, before, char, prompt_bytes, after)
    assert tokenizer.decode(prompt).endswith(REPLACEMENT)

    deltas, tail = stream(tokenizer, prompt, output)

    assert next(d for d in deltas if d) == char
    assert_clean_stream(deltas, char + after)
    assert tail == ""


def test_prompt_token_with_a_space_and_the_first_bytes_of_an_emoji_streams_only_generated_text(
    tokenizer: Any,
) -> None:
    ids = encode(tokenizer, "Say 👍 now")  # 'Say', ' \xf0\x9f\x91', '\x8d', ' now': natural tokenization
    prompt, output = ids[:2], ids[2:]
    assert tokenizer.decode(prompt) == "Say " + REPLACEMENT

    deltas, tail = stream(tokenizer, prompt, output)

    assert_clean_stream(deltas, "👍 now")


def test_prompt_window_starting_inside_a_character_streams_only_generated_text(tokenizer: Any) -> None:
    prompt = encode(tokenizer, "Hieroglyphs: ") + byte_ids(tokenizer, "𓀀") + byte_ids(tokenizer, "𓀁")[:3]
    output = byte_ids(tokenizer, "𓀁")[3:] + encode(tokenizer, " ok")

    deltas, tail = stream(tokenizer, prompt, output)

    assert_clean_stream(deltas, "𓀁 ok")


def test_prompt_ending_with_a_literal_replacement_character_is_not_streamed(tokenizer: Any) -> None:
    prompt = encode(tokenizer, "garbled input: " + REPLACEMENT)
    output = encode(tokenizer, " ok fine")

    deltas, tail = stream(tokenizer, prompt, output)

    assert_clean_stream(deltas, " ok fine")


# ============================================================================ special tokens
def test_skip_special_tokens_leaves_them_out_of_the_text(tokenizer: Any) -> None:
    output = encode(tokenizer, "Hello<|im_end|>\n<|endoftext|>价格")

    deltas, tail = stream(tokenizer, encode(tokenizer, "<|im_start|>assistant\n"), output)

    assert_clean_stream(deltas, "Hello\n价格")
    assert tail == ""


def test_special_tokens_are_kept_when_not_skipped(tokenizer: Any) -> None:
    output = encode(tokenizer, "Hello<|im_end|>\n<|endoftext|>价格")

    deltas, tail = stream(tokenizer, encode(tokenizer, "<|im_start|>assistant\n"), output, skip_special_tokens=False)

    assert_clean_stream(deltas, "Hello<|im_end|>\n<|endoftext|>价格")
    assert "<|im_end|>" in deltas
    assert tail == ""


def test_special_token_between_the_bytes_of_a_character_is_skipped(tokenizer: Any) -> None:
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = encode(tokenizer, "ok ")
    ids += byte_ids(tokenizer, "价")[:2] + [im_end] + byte_ids(tokenizer, "价")[2:] + encode(tokenizer, "!")

    deltas, tail = stream(tokenizer, [], ids)

    assert_clean_stream(deltas + [tail], tokenizer.decode(ids, skip_special_tokens=True))


# ============================================================================ flush
def test_flush_returns_the_held_back_bytes_of_an_unfinished_character(tokenizer: Any) -> None:
    output = encode(tokenizer, "价格是") + byte_ids(tokenizer, "👍")[:2]
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Q: "))

    deltas = [detok.step(token_id) for token_id in output]
    tail = detok.flush()

    assert "".join(deltas) == "价格是"
    assert tail == tokenizer.decode(output)[len("价格是"):] and tail.startswith(REPLACEMENT)
    assert detok.flush() == ""  # nothing is returned twice


def test_flush_after_whole_characters_returns_nothing(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [])
    for token_id in encode(tokenizer, MIXED):
        detok.step(token_id)

    assert detok.flush() == ""
    assert detok.text == MIXED


def test_flush_returns_the_unfinished_tail_after_a_character_begun_in_the_prompt(tokenizer: Any) -> None:
    prompt, output = prompt_ending_inside_a_character(tokenizer, "The price: ", "价", 1, "")
    output += byte_ids(tokenizer, "格")[:2]

    deltas, tail = stream(tokenizer, prompt, output)

    assert "".join(deltas) == "价"
    assert tail == REPLACEMENT


# ============================================================================ random text
TRICKY = list("价格是元ďáéñ삼겹살👍🏽🫠𓀀𝄞🇯🇵 \n\t!a0") + ["\u200d", "e\u0301"]
TEXT = st.lists(st.sampled_from(TRICKY) | st.characters(exclude_categories=("Cs",), exclude_characters=REPLACEMENT),
                max_size=24).map("".join)
RANDOM = settings(max_examples=200, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@RANDOM
@given(text=TEXT, cut=st.integers(0, 24), sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_random_text_split_between_characters_streams_exactly(
    tokenizer: Any, text: str, cut: int, sizes: list[int]
) -> None:
    prompt = encode(tokenizer, text[:cut])
    output = encode(tokenizer, text[cut:])

    deltas, tail = stream(tokenizer, prompt, output, group_sizes=sizes)

    assert_clean_stream(deltas, tokenizer.decode(output))
    assert tail == ""


@RANDOM
@given(text=TEXT, cut=st.integers(0, 64), sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_random_text_split_after_a_token_ending_a_character_streams_exactly(
    tokenizer: Any, text: str, cut: int, sizes: list[int]
) -> None:
    ids = encode(tokenizer, text)
    cut = min(cut, len(ids))
    while tokenizer.decode(ids[:cut]).endswith(REPLACEMENT):
        cut -= 1  # the prompt ends on a whole character; the output ids may still split characters
    prompt, output = ids[:cut], ids[cut:]

    deltas, tail = stream(tokenizer, prompt, output, group_sizes=sizes)

    assert_clean_stream(deltas, tokenizer.decode(ids)[len(tokenizer.decode(prompt)):])
    assert tail == ""


@RANDOM
@given(text=TEXT, cut=st.integers(0, 64))
@example(text="Say 👍 now", cut=2)
def test_random_text_split_anywhere_streams_exactly(tokenizer: Any, text: str, cut: int) -> None:
    ids = encode(tokenizer, text)
    cut = min(cut, len(ids))
    prompt, output = ids[:cut], ids[cut:]
    generated = tokenizer.decode(ids)[len(whole_prompt_text(tokenizer, prompt)):]

    deltas, tail = stream(tokenizer, prompt, output)

    assert_clean_stream(deltas + [tail], generated)


@RANDOM
@given(ids=st.lists(st.integers(0, 151_668), max_size=40), prompt=st.lists(st.integers(0, 151_668), max_size=6))
def test_any_ids_stream_what_one_utf8_decoder_over_their_bytes_gives(
        tokenizer: Any, ids: list[int], prompt: list[int]) -> None:
    """Whole-character tokens take a cached text instead of the UTF-8 decoder: any ids (lone continuation bytes,
    the first bytes of a character, special tokens) stream what one incremental decoder over all their bytes
    gives."""
    import codecs

    from frontend.detokenizer import token_bytes_table

    table = token_bytes_table(tokenizer)
    reference = codecs.getincrementaldecoder("utf-8")(errors="replace")
    reference.decode(b"".join(table(t, True) for t in prompt[-4:]))
    detok = IncrementalDetokenizer(tokenizer, prompt)

    for token_id in ids:
        assert detok.step(token_id) == reference.decode(table(token_id, True))
    assert detok.flush() == reference.decode(b"", final=True)


@RANDOM
@given(ids=st.lists(st.integers(0, 151_668), min_size=1, max_size=40),
       prompt=st.lists(st.integers(0, 151_668), max_size=6), cut=st.integers(0, 40), emit_last=st.booleans(),
       skip=st.booleans())
def test_steps_gives_the_text_of_step_after_step(tokenizer: Any, ids: list[int], prompt: list[int], cut: int,
                                                 emit_last: bool, skip: bool) -> None:
    """`steps` (a deferred sample's tokens at its end, decoded at once) against `step` token by token: the same
    text, the last token's text left out when asked, the same state after (a later step and the flush agree)."""
    one, batch = IncrementalDetokenizer(tokenizer, prompt, skip), IncrementalDetokenizer(tokenizer, prompt, skip)
    first, rest = ids[:cut], ids[cut:]
    expected = "".join(one.step(t) for t in first)
    expected += "".join(one.step(t, emit_last or i < len(rest) - 1) for i, t in enumerate(rest))
    assert batch.steps(first) + batch.steps(rest, emit_last) == expected
    assert batch.token_ids == one.token_ids == ids
    assert batch.step(ids[0]) == one.step(ids[0])
    assert batch.flush() == one.flush()
    assert batch.text == one.text
