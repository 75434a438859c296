"""OpenAI's response bodies and stream chunks, built from the engine's `RequestOutput`s.

An HTTP request runs one engine request per prompt, each with `n` samples. Choice `prompt * n + sample`
is sample `sample` of prompt `prompt` (vLLM's numbering: a completion of two prompts with n = 3 has
choices 0..5, the first three of the first prompt); chat has one prompt, so its choices are the samples.

Streams interleave the choices as OpenAI does: every chunk holds one choice, tagged with its `index`, in
the order the engine produced the text; each choice ends with its own chunk carrying its `finish_reason`
(and vLLM's `stop_reason`). Chat streams open with a role chunk per choice. A chat choice's text is read
into reasoning, content and tool calls (`frontend/chat_output.py`): its message and deltas take their
shapes, and a choice that made calls and stopped by itself finishes with "tool_calls".

Logprobs take OpenAI's shapes (vLLM's, where OpenAI has none):
- chat: `choices[i].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
  bytes}]}], "refusal": None}`, the top entries most likely first;
- completions: `choices[i].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}`, where each
  `top_logprobs` entry maps token text to logprob, the sampled token first (up to `logprobs` + 1
  entries), and `text_offset` is each token's character offset in the choice's text, as the token texts
  add up (vLLM's rule);
- `prompt_logprobs` (vLLM): per prompt token, None for the first, else `{token id: {logprob, rank,
  decoded_token}}` with the prompt token and the top N; in each completion choice, at the top of a chat
  response.
JSON has no infinity: a logprob of -inf is written as -9999.0, as OpenAI and vLLM write it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from common.protocol import PositionLogprobs, RequestOutput, SampleOutput, TopLogprob
from frontend.chat_output import AssistantMessage, ChatOutputReader

LOGPROB_FLOOR = -9999.0
SSE_DONE = "data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> str:
    """One Server-Sent Event carrying `data` as compact JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def logprob_value(logprob: float) -> float:
    """`logprob` as JSON can carry it: -inf (and NaN) become `LOGPROB_FLOOR`."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def _token_entry(entry: PositionLogprobs | TopLogprob) -> dict[str, Any]:
    """OpenAI's `{token, logprob, bytes}`: `bytes` are the token's own, also for a piece of a character (whose
    `token` text shows U+FFFD), so that a client can join the pieces back into the character."""
    data = entry.token_bytes if entry.token_bytes is not None else entry.decoded_token.encode("utf-8", "replace")
    return {"token": entry.decoded_token, "logprob": logprob_value(entry.logprob), "bytes": list(data)}


def chat_logprobs(entries: list[PositionLogprobs]) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object for these output tokens."""
    return {"content": [{**_token_entry(e), "top_logprobs": [_token_entry(t) for t in e.top]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[PositionLogprobs], text_offset: int) -> dict[str, Any]:
    """OpenAI's completion `logprobs` object for these output tokens, the first at character `text_offset`."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for e in entries:
        tokens.append(e.decoded_token)
        token_logprobs.append(logprob_value(e.logprob))
        top = {e.decoded_token: logprob_value(e.logprob)}
        for t in e.top:
            top.setdefault(t.decoded_token, logprob_value(t.logprob))
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(e.decoded_token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def prompt_logprobs(positions: list[PositionLogprobs | None] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` list (None when not asked for)."""
    if positions is None:
        return None
    out: list[dict[str, Any] | None] = []
    for p in positions:
        if p is None:
            out.append(None)
            continue
        entry = {str(p.token_id): {"logprob": logprob_value(p.logprob), "rank": p.rank,
                                   "decoded_token": p.decoded_token}}
        for rank, t in enumerate(p.top, 1):
            entry.setdefault(str(t.token_id), {"logprob": logprob_value(t.logprob), "rank": rank,
                                               "decoded_token": t.decoded_token})
        out.append(entry)
    return out


def incomplete_constraint(sample: SampleOutput) -> dict[str, Any]:
    """The non-standard choice field `structured_output_incomplete: true` of a sample that max_tokens cut before its
    structured-output constraint was complete (finish reason "length", text that does not match); nothing
    otherwise. The `openai` client keeps it in the choice's `model_extra`."""
    return {"structured_output_incomplete": True} if sample.structured_output_incomplete else {}


class Choices:
    """What one HTTP request has produced so far: per choice its output tokens, the characters of its text
    and whether its end was sent; per prompt the latest output of its engine request (prompt tokens,
    prefix-cache hits, timings). `usage()` counts from these."""

    def __init__(self, num_prompts: int, n: int, eos_token_id: int | None) -> None:
        self.n = n
        self.eos_token_id = eos_token_id
        self.requests: list[RequestOutput | None] = [None] * num_prompts
        self.num_tokens = [0] * (num_prompts * n)
        self.num_chars = [0] * (num_prompts * n)
        self.ended = [False] * (num_prompts * n)

    def add(self, prompt: int, out: RequestOutput) -> list[tuple[int, SampleOutput, int]]:
        """Count the news of `out`, an output of prompt `prompt`'s request. Returns (choice index, the
        sample's news, the characters of that choice's text before this news) per sample with news."""
        self.requests[prompt] = out
        news = []
        for sample in out.outputs:
            choice = prompt * self.n + sample.index
            news.append((choice, sample, self.num_chars[choice]))
            self.num_tokens[choice] += len(sample.token_ids)
            self.num_chars[choice] += len(sample.text)
        return news

    def stop_reason(self, sample: SampleOutput) -> int | str | None:
        """vLLM's `stop_reason`: the stop string or stop token id that ended the sample; None when it ended
        at the tokenizer's end-of-sequence token or for any other reason."""
        reason = sample.stop_reason
        if sample.finish_reason != "stop" or (isinstance(reason, int) and reason == self.eos_token_id):
            return None
        return reason

    def usage(self) -> dict[str, Any]:
        """OpenAI's `usage`, with our `prompt_tokens_details.cached_tokens`, `ttft_s` (the slowest first
        token) and `tpot_s` (the mean over prompts of the time per output token after the first, along the
        longest sample)."""
        outs = [o for o in self.requests if o is not None]
        num_prompt = sum(o.num_prompt_tokens for o in outs)
        num_completion = sum(self.num_tokens)
        ttfts = [o.metrics["ttft_s"] for o in outs if o.metrics.get("ttft_s")]
        tpots = []
        for prompt, out in enumerate(self.requests):
            longest = max(self.num_tokens[prompt * self.n: (prompt + 1) * self.n])
            if out is not None and longest > 1 and "e2e_s" in out.metrics and "ttft_s" in out.metrics:
                tpots.append((out.metrics["e2e_s"] - out.metrics["ttft_s"]) / (longest - 1))
        return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
                "total_tokens": num_prompt + num_completion,
                "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)},
                "ttft_s": max(ttfts) if ttfts else None, "tpot_s": sum(tpots) / len(tpots) if tpots else None}


# ---------------------------------------------------------------------------------------------- whole responses
def completion_response(head: dict[str, Any], outs: list[RequestOutput], choices: Choices) -> dict[str, Any]:
    """The body of a non-streamed completion: `head` (id, object, created, model) and a choice per sample
    of each prompt's finished output in `outs`."""
    items = []
    for prompt, out in enumerate(outs):
        prompt_lps = prompt_logprobs(out.prompt_logprobs)
        for choice, sample, _ in choices.add(prompt, out):
            items.append({"index": choice, "text": sample.text,
                          "logprobs": None if sample.logprobs is None else completion_logprobs(sample.logprobs, 0),
                          "finish_reason": sample.finish_reason, "stop_reason": choices.stop_reason(sample),
                          "prompt_logprobs": prompt_lps, **incomplete_constraint(sample)})
    return {**head, "choices": items, "system_fingerprint": None, "usage": choices.usage()}


Reader = Callable[[bool | None], ChatOutputReader]  # a chat sample's reader, given its output's prompt_reasoning


def chat_response(head: dict[str, Any], out: RequestOutput, choices: Choices,
                  reader: Reader = lambda _: ChatOutputReader()) -> dict[str, Any]:
    """The body of a non-streamed chat completion: a choice per sample of the finished output `out`, its text
    read into OpenAI's message by a fresh `reader` (reasoning, content, tool calls)."""
    items = []
    for choice, sample, _ in choices.add(0, out):
        message = read_whole(reader(out.prompt_reasoning), sample.text)
        items.append({"index": choice, "message": message.to_openai(),
                      "logprobs": None if sample.logprobs is None else chat_logprobs(sample.logprobs),
                      "finish_reason": message.finish_reason(sample.finish_reason),
                      "stop_reason": choices.stop_reason(sample), **incomplete_constraint(sample)})
    return {**head, "choices": items, "system_fingerprint": None, "usage": choices.usage(),
            "prompt_logprobs": prompt_logprobs(out.prompt_logprobs)}


def read_whole(reader: ChatOutputReader, text: str) -> AssistantMessage:
    reader.feed(text)
    reader.finish()
    return reader.message()


# ---------------------------------------------------------------------------------------------- streams
class ChunkWriter:
    """The SSE chunks of one streamed response, from the engine's outputs as they come: `opening`, then
    `news` for every output of every prompt, then `closing` (the usage chunk when asked for). With
    `include_usage` every other chunk has `"usage": null`; with `continuous` the usage so far."""

    def __init__(self, head: dict[str, Any], choices: Choices, include_usage: bool, continuous: bool) -> None:
        self.head = head
        self.choices = choices
        self.include_usage = include_usage
        self.continuous = include_usage and continuous

    def chunk(self, choice: dict[str, Any]) -> str:
        usage = {"usage": self.choices.usage() if self.continuous else None} if self.include_usage else {}
        return sse({**self.head, "choices": [choice], **usage})

    def opening(self, firsts: list[RequestOutput]) -> list[str]:
        for prompt, out in enumerate(firsts):  # prompt tokens for a continuous usage of the first chunks
            self.choices.requests[prompt] = out
        return []

    def news(self, prompt: int, out: RequestOutput) -> list[str]:
        events = []
        for choice, sample, offset in self.choices.add(prompt, out):
            if self.choices.ended[choice]:
                continue
            events.extend(self.chunk(c) for c in self.content(choice, sample, offset, out))
            if sample.finish_reason is not None and sample.finish_reason != "error":  # an error ends the stream
                self.choices.ended[choice] = True
                events.append(self.chunk(self.end(choice, sample)))
        return events

    def closing(self) -> list[str]:
        return [sse({**self.head, "choices": [], "usage": self.choices.usage()})] if self.include_usage else []

    def content(self, choice: int, sample: SampleOutput, offset: int, out: RequestOutput) -> list[dict[str, Any]]:
        """The chunks (choice objects) of a sample's news, before its end chunk."""
        raise NotImplementedError

    def end(self, choice: int, sample: SampleOutput) -> dict[str, Any]:
        raise NotImplementedError


class CompletionChunks(ChunkWriter):
    def content(self, choice: int, sample: SampleOutput, offset: int, out: RequestOutput) -> list[dict[str, Any]]:
        if not sample.text and not sample.logprobs:
            return []
        logprobs = None if sample.logprobs is None else completion_logprobs(sample.logprobs, offset)
        return [{"index": choice, "text": sample.text, "logprobs": logprobs, "finish_reason": None,
                 "stop_reason": None}]

    def end(self, choice: int, sample: SampleOutput) -> dict[str, Any]:
        return {"index": choice, "text": "", "logprobs": None, "finish_reason": sample.finish_reason,
                "stop_reason": self.choices.stop_reason(sample), **incomplete_constraint(sample)}


class ChatChunks(ChunkWriter):
    """Chat chunks: each choice's text read as it streams by its own `reader` (reasoning, content and tool-call
    deltas, `frontend/chat_output.py`); a step's logprobs ride on its first chunk."""

    def __init__(self, head: dict[str, Any], choices: Choices, include_usage: bool, continuous: bool,
                 reader: Reader = lambda _: ChatOutputReader()) -> None:
        super().__init__(head, choices, include_usage, continuous)
        self.reader = reader
        self.readers: dict[int, ChatOutputReader] = {}

    def opening(self, firsts: list[RequestOutput]) -> list[str]:
        super().opening(firsts)
        return [self.chunk({"index": choice, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}) for choice in range(len(self.choices.ended))]

    def content(self, choice: int, sample: SampleOutput, offset: int, out: RequestOutput) -> list[dict[str, Any]]:
        reader = self.readers.get(choice)
        if reader is None:
            reader = self.readers[choice] = self.reader(out.prompt_reasoning)
        deltas = reader.feed(sample.text)
        if sample.finish_reason is not None and sample.finish_reason != "error":
            deltas += reader.finish()
        if not deltas and sample.logprobs:
            deltas = [{"content": ""}]
        logprobs = None if sample.logprobs is None else chat_logprobs(sample.logprobs)
        return [{"index": choice, "delta": delta, "logprobs": logprobs if i == 0 else None, "finish_reason": None}
                for i, delta in enumerate(deltas)]

    def end(self, choice: int, sample: SampleOutput) -> dict[str, Any]:
        reader = self.readers.get(choice)
        made_calls = reader is not None and reader.num_calls > 0 and sample.finish_reason == "stop"
        return {"index": choice, "delta": {}, "logprobs": None,
                "finish_reason": "tool_calls" if made_calls else sample.finish_reason,
                "stop_reason": self.choices.stop_reason(sample), **incomplete_constraint(sample)}
