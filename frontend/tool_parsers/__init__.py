"""Tool-call parsers: the calls a model wrote in its output text, and the text around them (vLLM's
`--tool-call-parser`, with vLLM's names).

- `hermes` (`hermes.py`): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call,
  text around them (Qwen3, Hermes, many fine-tunes);
- `llama3_json` (`llama3_json.py`): a JSON object `{"name": ..., "parameters": {...}}` as the whole output, after an
  optional `<|python_tag|>`, several separated by `;` (Llama 3.1 to 3.3).

`tool_choice` "required" and a named function do not depend on the parser: the structured-output grammar makes the
model write a JSON array of `{"name", "parameters"}` objects, or the function's arguments object, and `forced.py`
reads those.

Every parser is a stream (`ToolCallStream`): `feed` takes the output's text delta by delta and returns the content
text and the call pieces (`ToolCallDelta`) it can tell apart so far, holding back only what may still be a tag;
`finish` ends it. `parse` runs a stream over a whole text, so a whole answer and its stream always agree. A call's
`arguments` are the JSON text of its arguments object as the model wrote it (whitespace included), so that the
pieces of a stream add up to it.

What counts as a call: a JSON object with a string `name`, and an arguments object (a missing one is `{}`).
Anything else (not JSON, no name, an unknown shape) stays content. A call whose arguments never finished (the
output was cut by max_tokens) was streamed as far as it went, but in a whole answer it is content, not a call:
its arguments would not parse.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from frontend.tool_parsers.json_call import CallScanner


def tool_call_id() -> str:
    """A new call id, in vLLM's form: `chatcmpl-tool-` and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    """One call: the function's `name`, its `arguments` as JSON text (an object), and its `id`."""

    name: str
    arguments: str
    id: str = field(default_factory=tool_call_id)

    def to_openai(self) -> dict[str, object]:
        """OpenAI's `tool_calls` entry: {"id", "type": "function", "function": {"name", "arguments"}}."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """A piece of a streamed call: the first piece of call `index` carries its `id` and `name` (and no
    arguments), the later ones the next characters of its `arguments` text."""

    index: int  # the call's place among the output's calls, from 0
    id: str | None = None
    name: str | None = None
    arguments: str = ""


Event = str | ToolCallDelta  # a stream's output: content text, or a piece of a call


@dataclass
class ParsedToolCalls:
    """A whole output read by a parser: its `content` (the text that is not a call; "" if none) and its `calls`."""

    content: str
    calls: list[ToolCall]


@dataclass
class ToolCallRecord:
    """A call as a stream reads it: its scanner, the output text it spans (`raw`, content again should it prove
    no call), its place among the calls once its name is known (`index`), and what of it was streamed."""

    scanner: CallScanner
    raw: str = ""
    index: int = -1  # -1 until its first piece is streamed
    id: str = field(default_factory=tool_call_id)
    arguments_sent: int = 0  # characters of the arguments streamed
    fixed_name: str | None = None  # a call whose name the request fixed (a named tool_choice)

    @property
    def name(self) -> str | None:
        return self.fixed_name or self.scanner.name

    def arguments(self) -> str:
        """The arguments text so far: its value in the object; "{}" when the object ended without one."""
        s = self.scanner
        if s.arguments_start < 0:
            return "{}" if s.done else ""
        return s.text[s.arguments_start: s.arguments_end if s.arguments_end >= 0 else len(s.text)]

    @property
    def complete(self) -> bool:
        """A call a whole answer returns: a name, and arguments that parse as a JSON object."""
        if self.name is None:
            return False
        try:
            return isinstance(json.loads(self.arguments()), dict)
        except ValueError:
            return False

    def tool_call(self) -> ToolCall:
        assert self.name is not None
        return ToolCall(self.name, self.arguments(), self.id)


class ToolCallStream:
    """The base of every parser's stream: content text with the whitespace around calls dropped, and each call's
    pieces (a first `ToolCallDelta` with its id and name, then its arguments as they grow).

    A subclass implements `_scan` (take the next text) and `_end` (the output ended), reporting content with
    `_content` and calls with `_start_call`, `_advance` and `_abandon`."""

    def __init__(self) -> None:
        self.records: list[ToolCallRecord] = []  # the calls streamed (their first piece sent), in order
        self._events: list[Event] = []
        self._pending_space = ""  # content whitespace held: dropped if a call follows it or the output ends

    @property
    def num_calls(self) -> int:
        return len(self.records)

    def feed(self, text: str) -> list[Event]:
        """The content and call pieces of the next delta `text` of the output, in order."""
        if text:
            self._scan(text)
        return self._take()

    def finish(self) -> list[Event]:
        """What is still held when the output ends. Whitespace held after the last content is given out only
        when the output made no call."""
        self._end()
        if not self.records and self._pending_space:
            self._events.append(self._pending_space)
        self._pending_space = ""
        return self._take()

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _scan(self, text: str) -> None:
        raise NotImplementedError

    def _end(self) -> None:
        raise NotImplementedError

    def _content(self, text: str) -> None:
        if not text:
            return
        body = text.rstrip()
        if body:
            self._events.append(self._pending_space + body)
            self._pending_space = ""
        self._pending_space += text[len(body):]

    def _start_call(self, argument_keys: tuple[str, ...], raw: str = "") -> ToolCallRecord:
        """A new call (not streamed until its name is known): the whitespace before it is dropped."""
        self._pending_space = ""
        return ToolCallRecord(CallScanner(argument_keys), raw)

    def _read_object(self, record: ToolCallRecord, held: str) -> str:
        """Feed the held text `held` to `record`'s scanner, keep what it took in `record.raw`, stream what the call
        gained (`_advance`); returns the text the scanner left (past the call's object)."""
        taken = record.scanner.feed(held)
        record.raw += held[:taken]
        self._advance(record)
        return held[taken:]

    def _advance(self, record: ToolCallRecord) -> None:
        """Stream what `record` gained: its first piece once its name is known, then its new arguments."""
        if record.name is None:
            return
        if record.index < 0:
            record.index = len(self.records)
            self.records.append(record)
            self._events.append(ToolCallDelta(record.index, record.id, record.name))
        arguments = record.arguments()
        if len(arguments) > record.arguments_sent:
            self._events.append(ToolCallDelta(record.index, arguments=arguments[record.arguments_sent:]))
            record.arguments_sent = len(arguments)

    def _abandon(self, record: ToolCallRecord) -> None:
        """`record` proved no call (before its name was known): its text is content."""
        assert record.index < 0
        self._content(record.raw)


def parse_with(stream: ToolCallStream, text: str) -> ParsedToolCalls:
    """A whole output read by `stream` (a fresh one): the complete calls, and the content, followed by the text of
    calls that never completed."""
    events = stream.feed(text) + stream.finish()
    content = "".join(e for e in events if isinstance(e, str))
    calls = [r.tool_call() for r in stream.records if r.complete]
    unfinished = "".join(r.raw for r in stream.records if not r.complete)
    return ParsedToolCalls(content + unfinished, calls)


class ToolParser:
    """A tool-call format: `name` (vLLM's), `stream()` for one output, `parse(text)` for a whole one."""

    name = ""

    def stream(self) -> ToolCallStream:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedToolCalls:
        """The calls and the content of a whole output."""
        return parse_with(self.stream(), text)


def tool_parsers() -> dict[str, ToolParser]:
    """Every parser by its name (vLLM's)."""
    from frontend.tool_parsers.hermes import HermesToolParser
    from frontend.tool_parsers.llama3_json import Llama3JsonToolParser

    return {p.name: p for p in (HermesToolParser(), Llama3JsonToolParser())}


TOOL_PARSER_NAMES = ("hermes", "llama3_json")  # tool_parsers()'s keys, for argument parsers


def get_tool_parser(name: str) -> ToolParser:
    """The parser named `name`; raises `ValueError` naming the known ones."""
    parser = tool_parsers().get(name)
    if parser is None:
        raise ValueError(f"unknown tool-call parser {name!r}: known are {', '.join(TOOL_PARSER_NAMES)}")
    return parser
