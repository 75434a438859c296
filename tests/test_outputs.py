"""The frontend's per-sample output (frontend/outputs.py) with the real Qwen3 tokenizer: stop strings over
token boundaries and multi-byte characters, never streamed, never matched in the prompt; stop-token text
left out; streamed deltas adding up to the final text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from common.sampling_params import SamplingParams
from frontend.outputs import SampleState, find_stop


@pytest.fixture(scope="module")
def tokenizer(qwen3_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)


def run_sample(tokenizer: Any, output_ids: list[int], params: SamplingParams, prompt: str = "Say something:",
               stop_token: int | None = None) -> tuple[SampleState, list[str], int]:
    """Feed `output_ids` one at a time as the frontend does, streaming after each; stop at a stop string.
    `stop_token`: the scheduler ends the sample with this (last) token. Returns the sample, the streamed
    text deltas and how many tokens were fed."""
    sample = SampleState(0, tokenizer, tokenizer(prompt)["input_ids"], params)
    deltas = []
    fed = 0
    for token in output_ids:
        fed += 1
        fired = sample.add(token, None, stop_token=token == stop_token)
        if fired:
            break
        if token == stop_token:
            sample.finish("stop")
            break
        if sample.has_news():
            deltas.append(sample.take(stream=True).text)
    else:
        sample.finish("length")
    deltas.append(sample.take(stream=True).text)
    return sample, deltas, fed


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def completing_token(tokenizer: Any, ids: list[int], text: str, stop: str) -> int:
    """Index of the token whose text completes the first occurrence of `stop` in `text`."""
    end = text.index(stop) + len(stop)
    for i in range(len(ids)):
        if len(tokenizer.decode(ids[: i + 1])) >= end:
            return i
    raise AssertionError("stop string not in text")


def tokens_spanned(tokenizer: Any, ids: list[int], text: str, stop: str) -> int:
    """How many tokens hold a part of the first occurrence of `stop` (a byte of one of its characters)."""
    start = text.index(stop)
    first = next(i for i in range(len(ids)) if len(tokenizer.decode(ids[: i + 1]).rstrip("\ufffd")) > start)
    return completing_token(tokenizer, ids, text, stop) - first + 1


CASES = [
    # (output text, stop string): split over two or three tokens, multi-byte characters around them
    ("The quick brown fox jumps over the lazy dog.", "fox jumps"),
    ("The quick brown fox jumps over the lazy dog.", "own fox ju"),
    ("价格是100元👍🏽，好的谢谢。", "元👍"),
    ("价格是100元👍🏽，好的谢谢。", "🏽，好"),
    ("naïve café résumé déjà vu", "é ré"),
]


@pytest.mark.parametrize(("text", "stop"), CASES)
def test_a_stop_string_over_token_boundaries_cuts_the_text_and_ends_the_ids(tokenizer: Any, text: str,
                                                                            stop: str) -> None:
    ids = ids_of(tokenizer, text)
    last = completing_token(tokenizer, ids, text, stop)
    assert tokens_spanned(tokenizer, ids, text, stop) >= 2
    sample, deltas, fed = run_sample(tokenizer, ids, SamplingParams(stop=[stop]))
    assert sample.finish_reason == "stop" and sample.stop_reason == stop
    assert sample.text == text[: text.index(stop)]
    assert sample.token_ids == ids[: last + 1] and fed == last + 1
    assert "".join(deltas) == sample.text  # what was streamed is exactly the final text


def test_the_cases_split_stop_strings_over_two_and_three_tokens(tokenizer: Any) -> None:
    spans = {tokens_spanned(tokenizer, ids_of(tokenizer, text), text, stop) for text, stop in CASES}
    assert {2, 3} <= spans, spans


@pytest.mark.parametrize(("text", "stop"), CASES)
def test_include_stop_str_in_output_keeps_the_stop_string_and_nothing_after_it(tokenizer: Any, text: str,
                                                                              stop: str) -> None:
    ids = ids_of(tokenizer, text)
    sample, deltas, _ = run_sample(tokenizer, ids, SamplingParams(stop=stop, include_stop_str_in_output=True))
    assert sample.text == text[: text.index(stop) + len(stop)]
    assert "".join(deltas) == sample.text


def test_text_from_a_stop_string_on_is_never_streamed(tokenizer: Any) -> None:
    text = "one two three four five six seven"
    ids = ids_of(tokenizer, text)
    sample, deltas, _ = run_sample(tokenizer, ids, SamplingParams(stop=["four five six"]))
    streamed_before_finish = "".join(deltas[:-1])
    assert "four" not in streamed_before_finish
    assert sample.text == "one two three "


def test_a_stop_string_in_the_prompt_or_across_prompt_and_output_does_not_fire(tokenizer: Any) -> None:
    params = SamplingParams(stop=["STOP", "brown fox"])
    sample, _, _ = run_sample(tokenizer, ids_of(tokenizer, " fox and a STO"), params, prompt="STOP the quick brown")
    assert sample.finish_reason == "length" and sample.text == " fox and a STO"


def test_of_overlapping_stop_strings_the_one_complete_first_wins(tokenizer: Any) -> None:
    text = "xx abcdef yy"
    ids = ids_of(tokenizer, text)
    for stops, cut, reason in [(["abcdef", "bcd", "abx"], "xx a", "bcd"), (["abcd", "abc"], "xx ", "abc"),
                               (["cde", "bcdef"], "xx ab", "cde")]:
        sample, deltas, _ = run_sample(tokenizer, ids, SamplingParams(stop=stops))
        assert (sample.text, sample.stop_reason) == (cut, reason), stops
        assert "".join(deltas) == cut


def test_find_stop_prefers_the_earliest_end_then_the_earliest_start() -> None:
    assert find_stop("xxabcd", 2, ["abcd", "bc"]) == (3, "bc")
    assert find_stop("xxabcd", 2, ["bcd", "abcd"]) == (2, "abcd")
    assert find_stop("xxabcd", 6, ["abcd"]) is None  # nothing new to search
    assert find_stop("xxabcd", 5, ["abcd"]) == (2, "abcd")  # ends in the new text


def test_stop_strings_wait_for_min_tokens(tokenizer: Any) -> None:
    ids = ids_of(tokenizer, "a b a b a b a b")
    sample, _, fed = run_sample(tokenizer, ids, SamplingParams(stop=["b"], min_tokens=3, max_tokens=16))
    assert fed == 4 and sample.text == "a b a " and sample.stop_reason == "b"


def test_a_stop_token_stays_in_the_ids_but_its_text_is_left_out(tokenizer: Any) -> None:
    """Issue 13: with skip_special_tokens=False the text used to end with <|endoftext|>."""
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = ids_of(tokenizer, "Hello there") + [eos]
    params = SamplingParams(skip_special_tokens=False)
    sample, deltas, _ = run_sample(tokenizer, ids, params, stop_token=eos)
    assert sample.text == "Hello there" and sample.token_ids == ids and sample.stop_reason == eos
    assert "".join(deltas) == "Hello there"
    kept, _, _ = run_sample(tokenizer, ids, SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True),
                            stop_token=eos)
    assert kept.text == "Hello there<|endoftext|>"
    plain = ids_of(tokenizer, "Hi") + [ids_of(tokenizer, "!")[0]]
    user_stop, _, _ = run_sample(tokenizer, plain, SamplingParams(stop_token_ids=[plain[-1]]), stop_token=plain[-1])
    assert user_stop.text == "Hi" and user_stop.stop_reason == plain[-1]


def test_the_tokenizers_eos_token_is_no_stop_reason_unless_eos_is_ignored(tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    ids = ids_of(tokenizer, "Hello") + [eos]
    at_eos, _, _ = run_sample(tokenizer, ids, SamplingParams(), stop_token=eos)
    assert (at_eos.finish_reason, at_eos.stop_reason) == ("stop", None)  # vLLM's rule
    listed, _, _ = run_sample(tokenizer, ids, SamplingParams(ignore_eos=True, stop_token_ids=[eos]), stop_token=eos)
    assert listed.stop_reason == eos  # with ignore_eos it stops only as the user's stop id


def test_streamed_deltas_add_up_to_the_final_text_with_stop_strings_held_back(tokenizer: Any) -> None:
    text = "价格 是 100元 👍🏽 and more text here, and so on. END of it"
    ids = ids_of(tokenizer, text)
    for stops in (["END"], ["元 👍🏽 a", "zzz"], ["nothing matches this one"]):
        sample, deltas, _ = run_sample(tokenizer, ids, SamplingParams(stop=stops))
        assert "".join(deltas) == sample.text
        expected = min((text.index(s) for s in stops if s in text), default=len(text))
        assert sample.text == text[:expected]


def test_logprobs_carry_the_bytes_of_tokens_that_hold_a_piece_of_a_character(tokenizer: Any) -> None:
    """A fresh user's trial: every emoji piece came back as token '\ufffd' with bytes [239, 191, 189] (U+FFFD's), so
    the bytes of the tokens could not be joined back into the text. Each piece now carries its own bytes, through
    the wire and into OpenAI's `bytes` field."""
    from common.protocol import Logprobs, RequestOutput, RequestOutputs, decode, encode, f32, i32
    from frontend.openai.responses import chat_logprobs
    from frontend.outputs import TokenTexts, sampled_logprobs

    text = "𝔘𝔫𝔦 🦜🪿 ᚠᛇᚻ"
    ids = tokenizer(text)["input_ids"]
    pieces = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert pieces, "the test text must split a character across tokens"
    texts = TokenTexts(tokenizer)
    top = [ids[0], pieces[0], 11]  # a whole token, a piece, another whole one
    sample = SampleState(0, tokenizer, [1], SamplingParams(logprobs=3))
    for token in ids:
        lp = Logprobs(i32([0]), i32([1]), i32([3]), f32([-0.5]), i32([1]), i32(top), f32([-0.5, -1.0, -2.0]))
        sample.add(token, sampled_logprobs(lp, i32([token]), texts)[0], stop_token=False)
    out = decode(encode(RequestOutputs([RequestOutput("r", logprobs=sample.take(stream=False).logprobs)])))
    entries = chat_logprobs(out.outputs[0].logprobs)["content"]

    assert bytes(b for e in entries for b in e["bytes"]).decode("utf-8") == text
    assert [e["token"] for e in entries] == [tokenizer.decode([i]) for i in ids]
    assert [e["top_logprobs"][1]["bytes"] for e in entries] == [list(texts.raw(pieces[0]))] * len(ids)
    assert entries[0]["top_logprobs"][2]["bytes"] == list(tokenizer.decode([11]).encode())
    assert texts.raw(11) is None and texts.raw(pieces[0]) is not None


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("skip_special", [True, False])
def test_a_sample_not_streamed_detokenizes_at_the_end_to_the_streamed_text(tokenizer: Any, include_stop: bool,
                                                                          skip_special: bool) -> None:
    """A sample that is neither streamed nor stopped by strings keeps only token ids while it runs; its final text
    equals the streamed sample's: multi-byte characters split across tokens, a character straddling the prompt,
    special tokens, and a stop token whose text is left out (or kept with include_stop_str_in_output)."""
    import numpy as np

    rng = np.random.default_rng(7)
    text = "naïve 日本語 🙂 — ok<|im_end|>"
    ids = ids_of(tokenizer, text)
    byte_tokens = [int(t) for t in rng.integers(0, 256, size=12)]  # raw byte tokens: invalid UTF-8 in between
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for output in (ids, byte_tokens + ids, [int(t) for t in rng.integers(0, 151643, size=40)]):
        for stop_token in (None, end):
            params = SamplingParams(skip_special_tokens=skip_special, include_stop_str_in_output=include_stop)
            prompt = tokenizer("Say 日")["input_ids"]
            streamed = SampleState(0, tokenizer, prompt, params, stream=True)
            deferred = SampleState(0, tokenizer, prompt, params, stream=False)
            assert deferred.deferred and not streamed.deferred
            for sample in (streamed, deferred):
                for i, token in enumerate(output):
                    sample.add(token, None, stop_token=stop_token is not None and i == len(output) - 1)
                assert len(sample.detokenizer.token_ids) == (0 if sample is deferred else len(output))
                sample.finish("stop" if stop_token is not None else "length")
            assert deferred.take(stream=False).text == streamed.take(stream=False).text
            assert deferred.stop_reason == streamed.stop_reason


def test_a_sample_with_stop_strings_is_detokenized_as_it_runs_even_unstreamed(tokenizer: Any) -> None:
    sample = SampleState(0, tokenizer, [1], SamplingParams(stop=["lo w"]), stream=False)
    assert not sample.deferred
    ids = ids_of(tokenizer, "hello world")
    fired = [sample.add(t, None, stop_token=False) for t in ids]
    assert any(fired) and sample.text == "hel" and sample.finish_reason == "stop"
