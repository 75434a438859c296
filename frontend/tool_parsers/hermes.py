"""The `hermes` tool-call format (Hermes 2 Pro, Qwen2.5, Qwen3 and the many fine-tunes that follow it): each call
is a JSON object in its own block,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

with any text before, between or after the blocks as content. `"parameters"` is taken for `"arguments"` too.
A block whose text is not such an object (no name, not JSON) stays content, tags included.
"""

from __future__ import annotations

from frontend.reasoning_parsers import held_prefix
from frontend.tool_parsers import ToolCallRecord, ToolCallStream, ToolParser

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")

# HermesStream states
_TEXT, _BEFORE_OBJECT, _OBJECT, _AFTER_OBJECT = range(4)


class HermesStream(ToolCallStream):
    """One output in the hermes format, read as it arrives."""

    def __init__(self) -> None:
        super().__init__()
        self._state = _TEXT
        self._held = ""  # text not read yet: a possible tag
        self._call: ToolCallRecord | None = None

    def _scan(self, text: str) -> None:
        self._held += text
        while self._held:
            if self._state == _TEXT:
                start = self._held.find(CALL_START)
                if start < 0:
                    keep = held_prefix(self._held, CALL_START)
                    self._content(self._held[: len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep:]
                    return
                self._content(self._held[:start])
                self._held = self._held[start + len(CALL_START):]
                self._call = self._start_call(ARGUMENT_KEYS, CALL_START)
                self._state = _BEFORE_OBJECT
            elif self._state == _BEFORE_OBJECT:
                call = self._call
                assert call is not None
                body = self._held.lstrip()
                call.raw += self._held[: len(self._held) - len(body)]
                self._held = body
                if not body:
                    return
                if body[0] != "{":  # not a call: the block is text
                    self._abandon(call)
                    self._call, self._state = None, _TEXT
                else:
                    self._state = _OBJECT
            elif self._state == _OBJECT:
                call = self._call
                assert call is not None
                self._held = self._read_object(call, self._held)
                if call.name is None and (call.scanner.done or call.scanner.failed):
                    self._abandon(call)
                    self._call, self._state = None, _TEXT
                elif call.scanner.done or call.scanner.failed:
                    self._state = _AFTER_OBJECT
            else:  # after the object: up to the end tag, nothing is content
                end = self._held.find(CALL_END)
                call = self._call
                assert call is not None
                if end < 0:
                    keep = held_prefix(self._held, CALL_END)
                    call.raw += self._held[: len(self._held) - keep]
                    self._held = self._held[len(self._held) - keep:]
                    return
                call.raw += self._held[: end + len(CALL_END)]
                self._held = self._held[end + len(CALL_END):]
                self._call, self._state = None, _TEXT

    def _end(self) -> None:
        held, self._held = self._held, ""
        call = self._call
        if self._state == _TEXT:
            self._content(held)
        elif call is not None and call.index < 0:  # a block that never showed a name: text
            call.raw += held
            self._abandon(call)
        elif call is not None:
            call.raw += held


class HermesToolParser(ToolParser):
    name = "hermes"

    def stream(self) -> HermesStream:
        return HermesStream()
