"""What the frontend keeps of a request's output, and turns into `RequestOutput`s for its client.

Per sample (`SampleState`): the token ids, the text, logprobs (with each token's text) and the finish.

Stop strings are matched on the detokenized output text, across token boundaries (never on the
prompt): after each token, each stop string is searched where it could end inside the new text; of
the matches, the one that is complete first wins (the earliest end, then the earliest start, as if the
text had arrived one character at a time). The text is cut before it (after it with
`include_stop_str_in_output`), the token ids end with the token that completed it, and the frontend
aborts the sample in the scheduler. While a sample runs, its last `max(len(stop)) - 1` characters are
held back from streaming, since they may begin a stop string; so no text from a stop string on is
ever streamed, and the streamed deltas add up to the final text. As in vLLM, stop strings are only
looked for once more than `min_tokens` tokens were generated.

A sample that is not streamed and has no stop string is detokenized once, when it finishes (`SampleState.deferred`):
while it runs, a step's token costs the frontend an append (at 256 rows, a step's frontend CPU halved on the CI
machine, benchmarks/frontend_cpu.py), and its final text is the same.

A stop token (an end token, or one of `stop_token_ids`) stays in the token ids, but its text is left
out unless `include_stop_str_in_output` (vLLM's behaviour); its id is the sample's `stop_reason`, except
for the tokenizer's own end-of-sequence token (unless `ignore_eos`), whose `stop_reason` is None, as in
vLLM (the model's other end tokens, from generation_config.json, count as stop token ids there too).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from common.protocol import LogprobColumns, Logprobs, PositionLogprobs, SampleOutput, TopLogprob
from common.sampling_params import SamplingParams
from frontend.detokenizer import IncrementalDetokenizer, token_bytes_table


class TokenTexts:
    """`tokenizer.decode([token_id])` of each token id, cached: the `decoded_token` of logprobs entries; and the
    raw bytes of the tokens whose text cannot hold them (`TopLogprob.token_bytes`)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}
        self.raw_cache: dict[int, bytes | None] = {}
        self._bytes = token_bytes_table(tokenizer)

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text

    def raw(self, token_id: int) -> bytes | None:
        """The token's bytes when they are not valid UTF-8 (a piece of a character: its text shows U+FFFD), for a
        byte-level tokenizer; else None."""
        if token_id in self.raw_cache:
            return self.raw_cache[token_id]
        data = self._bytes(token_id, False) if self._bytes is not None else b""
        try:
            data.decode("utf-8")
            found = None
        except UnicodeDecodeError:
            found = data
        self.raw_cache[token_id] = found
        return found

    def raw_if_split(self, token_id: int, text: str) -> bytes | None:
        """`raw(token_id)` for a token whose text `text` shows U+FFFD (only those can be a piece of a character);
        None for any other."""
        return self.raw(token_id) if "\ufffd" in text else None

    def raw_of(self, token_id: int, top_ids: list[int], top_texts: list[str], text: str) -> dict[int, bytes] | None:
        """`LogprobColumns.append`'s `raw` for one position: -1 for its token, i for top entry i; None if none."""
        if "\ufffd" not in text and "\ufffd" not in "".join(top_texts):  # almost every position: one search
            return None
        raw = {i: b for i, (t, x) in enumerate(zip(top_ids, top_texts)) if (b := self.raw_if_split(t, x))}
        if b := self.raw_if_split(token_id, text):
            raw[-1] = b
        return raw or None


def find_stop(text: str, new_from: int, stops: list[str]) -> tuple[int, str] | None:
    """The stop string that is complete first in `text` among those ending after index `new_from` (the
    text before it was searched already): (its start, the string), or None."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop, max(0, new_from - len(stop) + 1))
        if start >= 0:
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
    return None if best is None else (best[1], best[2])


def iter_positions(lp: Logprobs) -> Iterator[tuple[int, float, int, list[int], list[float]]]:
    """Each position of `lp` in order: (row, logprob, rank, top token ids, top logprobs)."""
    rows, counts, num_top = lp.rows.tolist(), lp.counts.tolist(), lp.num_top.tolist()
    token_lps, ranks = lp.token_logprobs.tolist(), lp.ranks.tolist()
    top_ids, top_lps = lp.top_token_ids.tolist(), lp.top_logprobs.tolist()
    p = t = 0
    for row, count, k in zip(rows, counts, num_top):
        for _ in range(count):
            yield row, token_lps[p], ranks[p], top_ids[t: t + k], top_lps[t: t + k]
            p += 1
            t += k


def position_logprobs(token_id: int, logprob: float, rank: int, top_ids: list[int], top_lps: list[float],
                      texts: TokenTexts) -> PositionLogprobs:
    text = texts(token_id)
    return PositionLogprobs(token_id, logprob, rank, text,
                            [TopLogprob(i, v, t, texts.raw_if_split(i, t)) for i, v in zip(top_ids, top_lps)
                             for t in (texts(i),)],
                            texts.raw_if_split(token_id, text))


class SampleState:
    """One sample of a request in the frontend."""

    def __init__(self, index: int, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams,
                 stream: bool = True) -> None:
        """`stream`: the client gets the output as it grows. A sample that is not streamed and has no stop string
        needs its text only once, when it finishes: its tokens are then detokenized all at once (the same text:
        the same incremental decoder, fed the same tokens), and a step's tokens cost the frontend an append."""
        self.index = index
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.stops = params.stop or []
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.holdback = max(map(len, self.stops)) - 1 if self.stops and not self.include_stop else 0
        self.deferred = not stream and not self.stops  # detokenize at the end (`_catch_up`)
        self._hide_last = False  # deferred: the last token is a stop token whose text is left out
        self._text = ""  # the output text so far, cut at a stop string
        self.token_ids: list[int] = []
        self.logprobs: LogprobColumns | None = LogprobColumns() if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # None: an end-of-sequence stop is not a stop reason (vLLM's rule; ignore_eos makes it a plain stop id)
        self.eos_token_id = None if params.ignore_eos else getattr(tokenizer, "eos_token_id", None)
        self.sent_chars = self.sent_tokens = self.sent_logprobs = 0  # already streamed to the client
        self.finish_sent = False
        self.structured_output_incomplete = False  # ended by "length" before its constraint was complete

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token_id: int, logprobs: SampledLogprobs | None, stop_token: bool) -> bool:
        """Add one sampled token (`stop_token`: the scheduler ends the sample with it) and its logprobs (from
        `sampled_logprobs`). Returns True when it completes a stop string: the sample is then finished with
        reason "stop"."""
        self.token_ids.append(token_id)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(token_id, *logprobs)
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + logprobs[0]
        if stop_token:
            self.stop_reason = None if token_id == self.eos_token_id else token_id
        if self.deferred:  # no stop string to look for: the text waits for the end
            self._hide_last = stop_token and not self.include_stop
            return False
        piece = self.detokenizer.step(token_id, emit=not stop_token or self.include_stop)
        if not piece:
            return False
        new_from = len(self._text)
        self._text += piece
        if not self.stops or len(self.token_ids) <= self.min_tokens:
            return False
        hit = find_stop(self._text, new_from, self.stops)
        if hit is None:
            return False
        start, stop = hit
        self._text = self._text[: start + len(stop) if self.include_stop else start]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    @property
    def text(self) -> str:
        """The output text so far (all of it, for a deferred sample), cut at a stop string."""
        if self.deferred:  # the others detokenize as their tokens come
            self._catch_up()
        return self._text

    def _catch_up(self) -> None:
        """Detokenize the tokens a deferred sample has not yet: only the last one can be a stop token (the sample
        ends with it), whose text is left out unless `include_stop_str_in_output`."""
        todo = self.token_ids[len(self.detokenizer.token_ids):]
        if todo:
            self._text += self.detokenizer.steps(todo, emit_last=not self._hide_last)

    def finish(self, reason: str) -> None:
        """End the sample (once; a sample a stop string ended keeps that). An unfinished character at the
        end of its text becomes U+FFFD, as `decode()` shows it."""
        if self.finished:
            return
        if self.deferred:
            self._catch_up()
        self._text += self.detokenizer.flush()
        self.finish_reason = reason
        if reason != "stop":
            self.stop_reason = None

    def visible_text(self) -> str:
        """The text a client may see now: all of it once finished, else all but the held-back tail."""
        text = self.text
        if self.finished or not self.holdback:
            return text
        return text[: max(self.sent_chars, len(text) - self.holdback)]

    def has_news(self) -> bool:
        """Whether a streamed output would tell the client something new about this sample."""
        return (len(self.token_ids) > self.sent_tokens or len(self.visible_text()) > self.sent_chars
                or (self.finished and not self.finish_sent))

    def take(self, stream: bool) -> SampleOutput:
        """The sample as the next output shows it: its news since the last one when streaming, else all."""
        text = self.visible_text()
        lps = self.logprobs
        if stream:
            out = SampleOutput(self.index, text[self.sent_chars:], self.token_ids[self.sent_tokens:],
                               self.finish_reason, self.stop_reason,
                               None if lps is None else lps.since(self.sent_logprobs), self.cumulative_logprob,
                               self.structured_output_incomplete)
        else:
            out = SampleOutput(self.index, text, list(self.token_ids), self.finish_reason, self.stop_reason,
                               None if lps is None else lps.since(0), self.cumulative_logprob,
                               self.structured_output_incomplete)
        self.sent_chars, self.sent_tokens = len(text), len(self.token_ids)
        self.sent_logprobs = len(lps) if lps is not None else 0
        self.finish_sent = self.finished
        return out


def prompt_logprobs_of(lp: Logprobs, prompt_by_seq: dict[int, tuple[list[int], list[PositionLogprobs | None]]],
                       texts: TokenTexts) -> None:
    """Append the prompt logprobs in `lp` (rows are seq ids) to each request's list: position i of the
    prompt is the next one after those received (position 0 is None)."""
    for seq_id, logprob, rank, top_ids, top_lps in iter_positions(lp):
        entry = prompt_by_seq.get(seq_id)
        if entry is None:
            continue
        prompt, received = entry
        position = len(received)
        if position < len(prompt):
            received.append(position_logprobs(prompt[position], logprob, rank, top_ids, top_lps, texts))


# The logprobs of one sampled token: its logprob, rank and text, its top entries' ids, logprobs and texts, and the
# bytes of those whose text cannot hold them (`LogprobColumns.append`'s `raw`).
SampledLogprobs = tuple[float, int, str, list[int], list[float], list[str], dict[int, bytes] | None]


def sampled_logprobs(lp: Logprobs | None, token_ids: np.ndarray, texts: TokenTexts) -> dict[int, SampledLogprobs]:
    """Index in a `StepOutputs` -> the logprobs of the token sampled there (for the rows that asked), as
    `SampleState.add` takes them (no object per entry: see `LogprobColumns`)."""
    if lp is None:
        return {}
    ids = token_ids.tolist()
    out: dict[int, SampledLogprobs] = {}
    cache, text_of, raw_of = texts.cache, texts, texts.raw_of
    for row, logprob, rank, top_ids, top_lps in iter_positions(lp):
        token = ids[row]
        text = cache.get(token) or text_of(token)  # the cache written out: six lookups a row
        top_texts = [cache.get(i) or text_of(i) for i in top_ids]
        out[row] = (logprob, rank, text, top_ids, top_lps, top_texts, raw_of(token, top_ids, top_texts, text))
    return out
