"""The output of a request whose tool_choice forces calls, whatever the parser (vLLM's rule): its grammar
(`frontend/tools.py`) makes the model write

- `"required"`: a JSON array of calls, `[{"name": "get_weather", "parameters": {"city": "Paris"}}, ...]` (one
  call at most with `parallel_tool_calls: false`);
- a named function: that function's arguments object alone, `{"city": "Paris"}`.

Read as the parsers are (`ToolCallStream`), so a whole answer and its stream agree. Text that is not what the
grammar allows (possible only when the output was cut, or another constraint interfered) is content.
"""

from __future__ import annotations

from frontend.tool_parsers import ToolCallRecord, ToolCallStream

# RequiredCallsStream states
_START, _ELEMENT, _OBJECT, _AFTER_ELEMENT, _END, _TEXT = range(6)


class RequiredCallsStream(ToolCallStream):
    """The JSON array of calls of tool_choice "required"."""

    def __init__(self) -> None:
        super().__init__()
        self._state = _START
        self._held = ""
        self._call: ToolCallRecord | None = None

    def _scan(self, text: str) -> None:
        self._held += text
        while self._held:
            if self._state in (_START, _ELEMENT, _AFTER_ELEMENT):
                body = self._held.lstrip()
                if not body:
                    return
                expected = {_START: "[", _ELEMENT: "{]", _AFTER_ELEMENT: ",]"}[self._state]
                if body[0] not in expected:
                    self._state = _TEXT
                    continue
                self._held = body[1:]
                if body[0] == "[" or body[0] == ",":
                    self._state = _ELEMENT
                elif body[0] == "]":
                    self._state = _END
                else:
                    self._call = self._start_call(("parameters",), "{")
                    self._call.scanner.feed("{")
                    self._state = _OBJECT
            elif self._state == _OBJECT:
                call = self._call
                assert call is not None
                self._held = self._read_object(call, self._held)
                if call.scanner.done and call.name is not None:
                    self._call, self._state = None, _AFTER_ELEMENT
                elif call.scanner.done or call.scanner.failed:
                    if call.index < 0:
                        self._abandon(call)
                    self._call, self._state = None, _TEXT
            elif self._state == _END:  # nothing may follow the array
                self._held = ""
            else:
                self._content(self._held)
                self._held = ""

    def _end(self) -> None:
        held, self._held = self._held, ""
        call = self._call
        if self._state == _TEXT:
            self._content(held)
        elif call is not None:
            call.raw += held
            if call.index < 0:
                self._abandon(call)


class NamedCallStream(ToolCallStream):
    """The arguments object of a named function's call: all of the output, its leading whitespace dropped."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._call = self._start_call(())
        self._call.fixed_name = name
        self._arguments = ""

    def _scan(self, text: str) -> None:
        call = self._call
        self._arguments += text if self._arguments else text.lstrip()
        call.raw = self._arguments
        # The whole output is the arguments, streamed as it comes but for trailing whitespace (it may be the end).
        call.scanner.text, call.scanner.arguments_start = self._arguments, 0
        call.scanner.arguments_end = len(self._arguments.rstrip())
        if call.scanner.arguments_end:
            self._advance(call)

    def _end(self) -> None:
        pass
