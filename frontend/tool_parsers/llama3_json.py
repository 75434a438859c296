"""The `llama3_json` tool-call format (Llama 3.1 to 3.3 with JSON tool calling): the whole output is one or more
JSON objects separated by `;`, optionally after `<|python_tag|>` (a special token, in the text only when special
tokens are kept),

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

`"arguments"` is taken for `"parameters"` too. An output that does not begin with `{` (or the tag) is content; so
is an object without a name, and everything from the first text after the calls that is not a `;` or whitespace.
"""

from __future__ import annotations

from frontend.tool_parsers import ToolCallRecord, ToolCallStream, ToolParser

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")

# Llama3JsonStream states
_START, _OBJECT, _BETWEEN, _TEXT = range(4)


class Llama3JsonStream(ToolCallStream):
    """One output in the llama3_json format, read as it arrives."""

    def __init__(self) -> None:
        super().__init__()
        self._state = _START
        self._held = ""  # text not read yet
        self._opening = ""  # the output's text before its first object (whitespace, the tag): content if no call
        self._call: ToolCallRecord | None = None

    def _scan(self, text: str) -> None:
        self._held += text
        while self._held:
            if self._state == _START:
                body = self._held.lstrip()
                if body.startswith(PYTHON_TAG):
                    body = body[len(PYTHON_TAG):].lstrip()
                elif PYTHON_TAG.startswith(body):  # nothing yet, or a part of the tag
                    return
                if not body:
                    return
                if body[0] != "{":  # no call: the whole output is content
                    self._state = _TEXT
                    continue
                self._opening, self._held = self._held[: len(self._held) - len(body)], body
                self._call, self._state = self._start_call(ARGUMENT_KEYS), _OBJECT
            elif self._state == _OBJECT:
                call = self._call
                assert call is not None
                self._held = self._read_object(call, self._held)
                if call.name is None and (call.scanner.done or call.scanner.failed):
                    self._abandon(call)
                    self._call, self._state = None, _TEXT
                elif call.scanner.done:
                    self._call, self._state = None, _BETWEEN
                elif call.scanner.failed:  # the call was streamed: what follows it is content
                    self._call, self._state = None, _TEXT
            elif self._state == _BETWEEN:
                self._held = self._held.lstrip(" \t\r\n;")
                if self._held[:1] == "{":
                    self._call, self._state = self._start_call(ARGUMENT_KEYS), _OBJECT
                elif self._held:
                    self._state = _TEXT
            else:
                self._content(self._held)
                self._held = ""

    def _abandon(self, record: ToolCallRecord) -> None:
        if not self.records:  # no call before it: the output's opening is content too
            record.raw = self._opening + record.raw
        super()._abandon(record)

    def _end(self) -> None:
        held, self._held = self._held, ""
        call = self._call
        if self._state in (_START, _TEXT):
            self._content(held)
        elif call is not None and call.index < 0:
            call.raw += held
            self._abandon(call)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream()
