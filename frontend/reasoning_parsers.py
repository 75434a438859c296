"""Reasoning parsers: a reasoning model's output split into its reasoning, the text inside `<think>...</think>`,
and its answer (vLLM's `--reasoning-parser`, with vLLM's names).

- `qwen3`: the output begins in the answer; it reasons only when it opens with `<think>` (after whitespace),
  until `</think>`.
- `deepseek_r1`: the output begins inside the reasoning (its `<think>` is optional: DeepSeek-R1's template writes it
  in the prompt), until `</think>`; without one, the whole output is reasoning.

The prompt may move the start: a chat template that ends the prompt with `<think>` (Qwen3-Thinking-2507) starts
the output inside the reasoning, and one that ends it with `<think>...</think>` (Qwen3's for `enable_thinking=False`)
leaves the whole output to the answer. The frontend, which holds the prompt, says which in
`RequestOutput.prompt_reasoning` (`prompt_reasoning` below): True, False, or None for neither.

Whitespace the template puts around the tags is not part of either text: the reasoning loses its leading and
trailing whitespace, the answer the whitespace right after `</think>` (Qwen3's template writes them back so).

A parser is pure text -> text: `split` for a whole output, `stream` for one output delta by delta; the deltas of
a stream add up to what `split` returns for the whole text. The workers use the tags' token ids to start a
structured-output grammar only after the reasoning (`SamplingOptions.reasoning_end_token_id`).
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


def held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and is shorter than it): characters that must
    wait for the next delta before they can be told apart from the tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True)
class ReasoningParser:
    """`name` (vLLM's), the tags around the reasoning, and whether an output begins inside the reasoning when the
    prompt does not say (`starts_inside`: True for DeepSeek-R1, False for Qwen3, which opens it with `start`)."""

    name: str
    starts_inside: bool
    start: str = THINK_START
    end: str = THINK_END

    def prompt_reasoning(self, prompt_tail: str) -> bool | None:
        """Where a prompt ending in `prompt_tail` leaves its output (`RequestOutput.prompt_reasoning`): True inside
        a reasoning block (the prompt ends with `start`), False after one (it ends with `end`), None neither
        (whitespace after the tag does not count)."""
        tail = prompt_tail.rstrip()
        if tail.endswith(self.end):
            return False
        if tail.endswith(self.start):
            return True
        return None

    def stream(self, prompt_reasoning: bool | None = None) -> ReasoningStream:
        """An incremental split of one output whose prompt left it as `prompt_reasoning` says."""
        return ReasoningStream(self, prompt_reasoning)

    def split(self, text: str, prompt_reasoning: bool | None = None) -> tuple[str | None, str]:
        """(reasoning, answer) of a whole output: None for the reasoning when the output has none (an empty
        reasoning block counts as none)."""
        stream = self.stream(prompt_reasoning)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        reasoning += more_reasoning
        return (reasoning if stream.reasoned and reasoning else None), content + more_content


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3", starts_inside=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_inside=True),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser named `name`; raises `ValueError` naming the known ones."""
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"unknown reasoning parser {name!r}: known are {', '.join(sorted(REASONING_PARSERS))}")
    return parser


# ReasoningStream states
_OPENING = "opening"  # the output may open with the start tag: held until it is told apart
_INSIDE = "inside"  # in the reasoning, until the end tag
_AFTER_END = "after end"  # just after the end tag: whitespace dropped
_ANSWER = "answer"  # the rest is the answer


class ReasoningStream:
    """One output split as its deltas arrive: `feed` returns each delta's (reasoning, answer) parts (the
    reasoning always comes first in the output), holding back what may still be a tag or whitespace around one;
    `finish` releases what is held at the end of the output."""

    def __init__(self, parser: ReasoningParser, prompt_reasoning: bool | None) -> None:
        self.parser = parser
        if prompt_reasoning is None:
            self.state = _OPENING
        else:
            self.state = _INSIDE if prompt_reasoning else _ANSWER
        self.reasoned = prompt_reasoning is True  # the output has a reasoning part (possibly empty)
        self._held = ""  # text not yet given out (a possible tag, whitespace)
        self._started = False  # some reasoning text was given out (its leading whitespace is dropped before)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of the next delta `text` of the output."""
        reasoning, content = [], []
        self._held += text
        while self._held:
            if self.state == _OPENING:
                body = self._held.lstrip()
                if self.parser.start.startswith(body):
                    if body == self.parser.start:  # the output opens the reasoning
                        self._held, self.state, self.reasoned = "", _INSIDE, True
                    break
                if body.startswith(self.parser.start):
                    self._held, self.state, self.reasoned = body[len(self.parser.start):], _INSIDE, True
                elif self.parser.starts_inside:  # no start tag: the reasoning began in the prompt
                    self.state, self.reasoned = _INSIDE, True
                else:
                    self.state = _ANSWER
            elif self.state == _INSIDE:
                end = self._held.find(self.parser.end)
                if end < 0:
                    keep = held_prefix(self._held, self.parser.end)
                    body = self._held[: len(self._held) - keep]
                    kept = len(body) - len(body.rstrip())  # trailing whitespace may precede the end tag
                    reasoning.append(self._reasoning(body[: len(body) - kept]))
                    self._held = self._held[len(body) - kept:]
                    break
                reasoning.append(self._reasoning(self._held[:end].rstrip()))
                self._held, self.state = self._held[end + len(self.parser.end):], _AFTER_END
            elif self.state == _AFTER_END:
                self._held = self._held.lstrip()
                if self._held:
                    self.state = _ANSWER
            else:
                content.append(self._held)
                self._held = ""
        return "".join(reasoning), "".join(content)

    def _reasoning(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        return text

    def finish(self) -> tuple[str, str]:
        """(reasoning, answer) still held when the output ends: a reasoning cut before its end tag keeps its
        text (its trailing whitespace dropped); a start tag never completed is answer text."""
        held, self._held = self._held, ""
        if self.state == _OPENING:
            if self.parser.starts_inside:
                self.reasoned = True
                return self._reasoning(held.rstrip()), ""
            return "", held
        if self.state == _INSIDE:
            return self._reasoning(held.rstrip()), ""
        if self.state == _ANSWER:
            return "", held
        return "", ""
